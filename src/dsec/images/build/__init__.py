"""Image builds: YAML spec -> cached layers -> image (see docs/images.md)."""

from dsec.images.build.builder import Builder, BuildResult
from dsec.images.build.runner import BuildRunner, RunResult, UnshareRunner, make_runner
from dsec.images.build.spec import BuildSpec, load_spec

__all__ = [
           "BuildResult",
           "BuildRunner",
           "BuildSpec",
           "Builder",
           "RunResult",
           "UnshareRunner",
           "load_spec",
           "make_runner",
]
