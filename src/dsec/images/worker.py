"""Layer import worker: ``python -m dsec.images.worker`` reads one JSON job on stdin
(store root, settings, archive, layer plan), imports that layer (ingest + verified unpack,
see ops._import_layer) and prints ``{"layer": ..., "misses": n}`` or ``{"error": ...}``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    from dsec.config import Settings
    from dsec.errors import DSecError
    from dsec.images.oci import LayerPlan, Source
    from dsec.images.ops import _import_layer
    from dsec.images.store import ImageStore

    job = json.loads(sys.stdin.read())
    archive = Path(job["archive"])
    try:
        st = ImageStore(Path(job["root"]), Settings.model_validate_json(job["settings"]))
        src = Source(archive)
        try:
            li, _ = _import_layer(st, src, archive, int(job["index"]), LayerPlan(**job["layer"]), None, 0)
        finally:
            src.close()
            st.db.close()
    except DSecError as exc:
        print(json.dumps({"error": exc.to_dict()}))
        return 1
    print(json.dumps({"layer": li.model_dump(), "misses": st.misses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
