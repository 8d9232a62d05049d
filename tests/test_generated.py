"""Checked-in generated sources match their generators (CPU only)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wgmma_header_matches_its_generator():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "scripts" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.OUT.read_text() == gen.render(), "ptx/common/wgmma_ops.cuh is stale: run python scripts/gen_wgmma.py"
