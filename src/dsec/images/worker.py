"""Layer import worker: ``python -m dsec.images.worker`` reads one JSON job on stdin
(store root, settings, archive, layer plan), imports that layer (ingest + verified unpack,
see ops._import_layer) and prints ``{"layer": ..., "misses": n}`` or ``{"error": ...}``.
A job ``{"root", "settings", "ensure": LayerInfo}`` instead unpacks (verified) one layer
whose blob is already in the content store (a registry pull's layers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.images.store import ImageStore
    from dsec.models.image import LayerInfo


def _run(job: dict[str, Any]) -> tuple[LayerInfo, ImageStore]:
    """Do the job; the layer and the store (for its miss count). Raises DSecError."""
    from dsec.config import Settings
    from dsec.images.oci import LayerPlan, Source
    from dsec.images.ops import _import_layer
    from dsec.images.store import ImageStore
    from dsec.models.image import LayerInfo

    st = ImageStore(Path(job["root"]), Settings.model_validate_json(job["settings"]))
    if "ensure" in job:  # unpack one layer whose blob is already in the store (registry pull)
        try:
            li = LayerInfo.model_validate(job["ensure"])
            st.ensure_layer(li)
        finally:
            st.db.close()
        return li, st
    archive = Path(job["archive"])
    try:
        src = Source(archive)
        try:
            li, _ = _import_layer(st, src, archive, int(job["index"]), LayerPlan(**job["layer"]), None, 0)
        finally:
            src.close()
    finally:
        st.db.close()
    return li, st


def main() -> int:
    from dsec.errors import DSecError

    job = json.loads(sys.stdin.read())
    try:
        li, st = _run(job)
    except DSecError as exc:
        print(json.dumps({"error": exc.to_dict()}))
        return 1
    print(json.dumps({"layer": li.model_dump(), "misses": st.misses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
