"""The light install for libraries (issue 25, README "Light install"): ``Lorsa``, ``LorsaConfig``,
``SparseAutoencoder``, ``Transcoder`` (and ``load`` / ``save`` of our format) import and run with torch and
safetensors alone (with numpy, which safetensors' torch writer imports).

Checked in a fresh interpreter where every other dependency of the package is made unimportable (``None`` in
``sys.modules``: ``import`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` answers None, as for
a package that is not installed) — nnsight, transformers, tokenizers, huggingface_hub, matplotlib, yaml, einops,
jaxtyping, tqdm …, as in an environment made by ``pip install torch safetensors numpy`` and ``pip install
--no-deps nnsight-lorsa``: the primitives import, run forward and backward, and the packaged Lorsa loads and runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: every distribution `pip install nnsight-lorsa` brings besides torch and safetensors (and optional extras)
BLOCKED = ["nnsight", "transformers", "tokenizers", "huggingface_hub", "matplotlib", "yaml", "einops", "jaxtyping",
           "beartype", "tqdm", "peft", "wandb", "sae_lens", "accelerate", "pandas", "PIL"]

SCRIPT = textwrap.dedent("""
    import sys

    BLOCKED = set(sys.argv[1].split(","))
    for name in BLOCKED:  # as if not installed: `import name` raises ModuleNotFoundError, find_spec(name) is None
        sys.modules[name] = None
    try:
        import nnsight  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker does not block")

    import torch

    import nnsight_lorsa
    from nnsight_lorsa import Lorsa, LorsaConfig, SparseAutoencoder, Transcoder, load, save
    from nnsight_lorsa.assets import default_lorsa_dir
    from nnsight_lorsa.modules import RotaryConfig, SAEConfig, TranscoderConfig

    assert nnsight_lorsa.__file__.startswith(sys.argv[2]), nnsight_lorsa.__file__
    torch.manual_seed(0)
    cpu = torch.device("cpu")

    rotary = RotaryConfig(head_dim=8, rotary_dim=8, base=10000.0)
    lorsa = Lorsa(LorsaConfig(d_model=16, n_qk_heads=2, d_qk_head=8, n_ov_heads=32, top_k=4, rotary=rotary))
    x = torch.randn(2, 5, 16, device=cpu, requires_grad=True)
    out = lorsa(x)
    assert out.shape == (2, 5, 16) and torch.isfinite(out).all()
    out.pow(2).sum().backward()
    assert x.grad is not None and lorsa.W_V.grad is not None and lorsa.W_Q.grad is not None

    sae = SparseAutoencoder(SAEConfig(d_in=16, d_sae=64, activation="topk", activation_params={"k": 4}))
    tc = Transcoder(TranscoderConfig(d_in=16, d_sae=64, activation="relu"))
    for module in (sae, tc):
        y = module(torch.randn(3, 16, device=cpu))
        assert y.shape == (3, 16)
        y.sum().backward()
        assert all(p.grad is not None for p in module.parameters() if p.requires_grad)

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        save(sae, tmp + "/sae")
        again = load(tmp + "/sae")
        probe = torch.randn(3, 16, device=cpu)
        assert torch.equal(again(probe), sae.eval()(probe))

    packaged = load(default_lorsa_dir() / "layer_2")
    z = packaged(torch.randn(1, 7, packaged.cfg.d_model, device=cpu))
    assert z.shape == (1, 7, packaged.cfg.d_model) and torch.isfinite(z).all()

    loaded = sorted(m for m, mod in sys.modules.items() if m.partition(".")[0] in BLOCKED and mod is not None)
    assert not loaded, loaded
    print("light install ok")
""")


def test_the_primitives_import_and_run_with_torch_and_safetensors_alone():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(BLOCKED), str(ROOT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "light install ok" in done.stdout, done.stdout + done.stderr


def test_the_blocker_would_catch_a_heavy_import(tmp_path):
    """The check can fail: a primitive that imported nnsight at module level would stop the script."""
    bad = tmp_path / "needs_nnsight.py"
    bad.write_text("import nnsight\n")
    script = SCRIPT.replace("import nnsight_lorsa\n", "import nnsight_lorsa\nimport needs_nnsight\n", 1)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, ",".join(BLOCKED), str(ROOT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "ModuleNotFoundError: import of nnsight halted" in done.stderr, done.stderr
