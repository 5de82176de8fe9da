"""Copy a wheel without the members a device run does not need, so the wheels carried to the GPU machine fit its 64 MiB
(bitsandbytes' CUDA 11/12 libraries beside the device's CUDA 13 one; Gradio's browser frontend and demo media,
which gradio_client's API calls never fetch). The Python code kept is byte for byte the wheel's; RECORD lists only
what is kept.

    python -m bench.slim_wheel .whl-min/bitsandbytes-*.whl .whl-gpu --drop 'bitsandbytes/libbitsandbytes_cuda1[12]*'
    python -m bench.slim_wheel /tmp/gradio-6.31.0-py3-none-any.whl .whl-gpu \
        --drop 'gradio/templates/frontend/assets/*' 'gradio/templates/node/*' 'gradio/media_assets/*'
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import zipfile
from pathlib import Path


def slim(source: Path, out_dir: Path, drop: list[str]) -> tuple[Path, int, int]:
    """Write `out_dir/<same name>` without the members matching any of `drop`; returns it, members kept, dropped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    kept = dropped = 0
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        gone = {n for n in names if any(fnmatch.fnmatch(n, pattern) for pattern in drop)}
        for info in src.infolist():
            if info.filename in gone:
                dropped += 1
                continue
            data = src.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",", 1)[0] not in gone).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            kept += 1
    return target, kept, dropped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheel", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--drop", nargs="+", required=True, help="fnmatch patterns of member paths to leave out")
    a = p.parse_args(argv)
    target, kept, dropped = slim(a.wheel, a.out_dir, a.drop)
    print(f"{target}: {kept} members kept, {dropped} dropped, {target.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
