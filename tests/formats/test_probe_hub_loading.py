"""Loading from the Hugging Face Hub, probed offline (the hub-loading probe, docs/reliability.md).

The Hub is a real ``huggingface_hub`` cache built on disk under ``tmp_path`` (``models--owner--name/blobs``,
``snapshots/<commit>/`` symlinks, ``refs/<revision>``), read by the real ``snapshot_download`` with
``HF_HUB_OFFLINE`` set (``huggingface_hub.constants`` patched, so no request leaves the machine whatever the
environment says). Checked against the same files read from a local folder and against the saved module cast
in plain torch: what loads is bit-equal, on the device and in the dtype asked for (default: the stored dtype;
a set's: its model's); every failure is one of our named errors naming the repo, revision or file; nothing is
unpickled; nothing is written into the cache by a load."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_lorsa, make_sae, make_transcoder, tiny_nnsight
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import ArgumentError, CheckpointError, LorsaError, PlacementError
from nnsight_lorsa.formats import load, resolve_release, save

huggingface_hub = pytest.importorskip("huggingface_hub")
from huggingface_hub import constants  # noqa: E402
from huggingface_hub.utils import filter_repo_objects  # noqa: E402


def probe(n: int) -> settings:
    """The probe's hypothesis settings: ``n`` draws, no deadline (a load reads files), fixtures per test."""
    return settings(max_examples=n, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink())


class Cache:
    """A ``huggingface_hub`` cache directory; :meth:`put` lays a local folder out as one commit of a repo."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list[dict] = []

    def store(self, repo_id: str) -> Path:
        return self.root / ("models--" + repo_id.replace("/", "--"))

    def put(self, repo_id: str, src: Path, *, prefix: str = "", refs: tuple[str, ...] = ("main",),
            skip: tuple[str, ...] = (), commit: str | None = None) -> str:
        """Copy ``src``'s files as ``prefix/<file>`` into a snapshot (one blob per content, relative symlinks
        as huggingface_hub makes them, files in ``skip`` left out) and point ``refs`` at it; returns the commit."""
        store = self.store(repo_id)
        commit = commit or hashlib.sha1(f"{repo_id}{prefix}{sorted(skip)}{src}".encode()).hexdigest()
        for rel in files_under(src):
            if rel in skip:
                continue
            data = (src / rel).read_bytes()
            blob = store / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = store / "snapshots" / commit / prefix / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (store / "refs").mkdir(parents=True, exist_ok=True)
        for ref in refs:
            (store / "refs" / ref).write_text(commit)
        return commit

    def listing(self) -> list[str]:
        return files_under(self.root)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache, offline; each ``snapshot_download`` call's arguments recorded in ``cache.calls`` (offline, the
    cached snapshot is returned whole: the recorded ``allow_patterns`` say what a download would have fetched)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # repo ids are no local paths here
    out = Cache(tmp_path / "hf-cache")
    out.calls = []
    real = huggingface_hub.snapshot_download

    def recorded(*args, **kwargs):
        out.calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recorded)
    return out


@pytest.fixture(scope="module")
def tiny():
    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model)


def tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def assert_placed(module: torch.nn.Module, like: torch.nn.Module, device: str, dtype: torch.dtype,
                  reference: torch.nn.Module | None = None) -> None:
    """``module``'s tensors are ``like``'s (names, shapes; values bit-equal unless on meta) and each floating one
    is on ``device`` in ``dtype``; with ``reference``, also equal to its tensors cast to ``dtype`` in plain torch."""
    got, want = tensors(module), tensors(like)
    assert got.keys() == want.keys()
    for name, t in got.items():
        assert t.device.type == device and want[name].device.type == device, name
        assert t.shape == want[name].shape and t.dtype == want[name].dtype, name
        if t.is_floating_point():
            assert t.dtype == dtype, (name, t.dtype, dtype)
        if device != "meta":
            assert torch.equal(t, want[name]), name
            if reference is not None:
                ref = tensors(reference)[name]
                assert torch.equal(t, ref.to(t.dtype) if ref.is_floating_point() else ref), name


# ----------------------------------------------------------------------------------- generated loads

_TINY: list = []


def tiny_lorsa():
    if not _TINY:
        model, hf = tiny_nnsight("llama")
        _TINY.extend([hf, get_adapter(model)])
    return make_lorsa(*_TINY, 1)


KINDS = {  # kind: (make the module, format written)
    "lorsa": (tiny_lorsa, "nnsight_lorsa"),
    "llamascopium_lorsa": (tiny_lorsa, "llamascopium"),
    "sae": (lambda: make_sae(), "nnsight_lorsa"),
    "skip_transcoder": (lambda: make_transcoder(), "nnsight_lorsa"),
    "saelens_sae": (lambda: make_sae(activation="relu"), "saelens"),
    "sparsify_sae": (lambda: make_sae(activation="topk", activation_params={"k": 8}), "sparsify"),
}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def draw_case(data: st.DataObject) -> dict:
    return {"kind": data.draw(st.sampled_from(sorted(KINDS)), "kind"),
            "stored": data.draw(st.sampled_from(DTYPES), "stored"),
            "subfolder": data.draw(st.sampled_from(["", "a", "a/b-c.1", "blocks.3.hook_resid_post"]), "subfolder"),
            "spelling": data.draw(st.sampled_from(["", "./", "/"]), "spelling"),  # "./a/", "a/": the same folder
            "spelled": data.draw(st.sampled_from(["kwarg", "colon"]), "spelled"),
            "revision": data.draw(st.sampled_from([None, "main", "v1.0", "commit"]), "revision"),
            "dtype": data.draw(st.sampled_from([None, *DTYPES]), "dtype"),
            "device": data.draw(st.sampled_from([None, "cpu", "meta"]), "device"),
            "format": data.draw(st.sampled_from(["auto", "given"]), "format")}


def check_load_case(tmp_path: Path, cache: Cache, case: dict, n: int) -> None:
    make, fmt = KINDS[case["kind"]]
    module = make().to(case["stored"]).eval()
    local = tmp_path / f"local{n}" / (case["subfolder"].rsplit("/", 1)[-1] or "top")
    save(module, local, format=fmt)
    repo = f"me/probe-{n}"
    commit = cache.put(repo, local, prefix=case["subfolder"], refs=("main", "v1.0"))
    before = cache.listing()
    source, kwargs = repo, {}
    if case["subfolder"]:
        spelled = case["subfolder"] + case["spelling"] if case["spelling"] != "./" else "./" + case["subfolder"]
        if case["spelled"] == "colon":
            source = f"{repo}:{spelled}"
        else:
            kwargs["subfolder"] = spelled
    revision = commit if case["revision"] == "commit" else case["revision"]
    placement = {"dtype": case["dtype"], "device": case["device"],
                 "format": fmt if case["format"] == "given" else "auto"}
    first = len(cache.calls)
    hub = load(source, revision=revision, **kwargs, **placement)
    # online, the download would fetch every file of the checkpoint (its manifest included) and nothing else
    patterns = [p for call in cache.calls[first:] for p in call["allow_patterns"]]
    in_repo = [f"{case['subfolder']}/{rel}" if case["subfolder"] else rel for rel in files_under(local)]
    assert sorted(filter_repo_objects(in_repo, allow_patterns=patterns)) == sorted(in_repo), patterns
    from_folder = load(local, **placement)
    dtype = case["dtype"] or case["stored"]
    if fmt == "llamascopium" and case["dtype"] is None:  # its bf16/fp16 files load upcast (docs/formats.md)
        dtype = torch.promote_types(dtype, torch.float32)
    device = case["device"] or "cpu"
    assert_placed(hub, from_folder, device, dtype, reference=module if fmt == "nnsight_lorsa" else None)
    assert type(hub) is type(from_folder)
    if fmt == "sparsify" and not case["subfolder"]:
        # the top of a snapshot is named by its commit hash: no hookpoint, where the local folder names one
        extra = hub.cfg.extra["sparsify"]
        assert hub.cfg.hook is None and extra["hookpoint"] is None and extra["site"] is None
        hub.cfg.hook, extra["hookpoint"] = from_folder.cfg.hook, "top"
    assert hub.cfg == from_folder.cfg
    assert cache.listing() == before  # a load reads the cache, never writes into it


@probe(12)
@given(data=st.data())
def test_a_hub_load_is_the_local_folders_load(tmp_path, cache, data):
    case = draw_case(data)
    check_load_case(tmp_path, cache, case, len(list(tmp_path.glob("local*"))))


@pytest.mark.slow
@probe(300)
@given(data=st.data())
def test_a_hub_load_is_the_local_folders_load_sweep(tmp_path, cache, data):
    case = draw_case(data)
    check_load_case(tmp_path, cache, case, len(list(tmp_path.glob("local*"))))


@probe(6)
@given(layers=st.sets(st.integers(0, 2), min_size=1, max_size=3),
       model_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       dtype=st.sampled_from([None, torch.float16, torch.float64]), subfolder=st.sampled_from(["", "sets/tiny"]))
def test_a_set_from_the_hub_is_on_its_model_in_its_dtype(tmp_path, cache, layers, model_dtype, dtype, subfolder):
    model, hf = tiny_nnsight("llama", dtype=model_dtype)
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {layer: make_lorsa(hf, adapter, layer, seed=layer) for layer in layers})
    local = tmp_path / f"set-{len(list(tmp_path.glob('set-*')))}"
    lorsas.save(local)
    repo = f"me/set-{local.name}"
    cache.put(repo, local, prefix=subfolder)
    first = len(cache.calls)
    back = LorsaSet.from_pretrained(model, f"{repo}:{subfolder}" if subfolder else repo, dtype=dtype)
    assert back.layers == sorted(layers)
    in_repo = [f"{subfolder}/{rel}" if subfolder else rel for rel in files_under(local)]
    patterns = [p for call in cache.calls[first:] for p in call["allow_patterns"]]
    assert sorted(filter_repo_objects(in_repo, allow_patterns=patterns)) == sorted(in_repo)
    for layer in layers:
        assert_placed(back[layer], LorsaSet.from_pretrained(model, local, dtype=dtype)[layer], "cpu",
                      dtype or model_dtype, reference=lorsas[layer])


# ----------------------------------------------------------------------------------- failures


@pytest.fixture
def lorsa_repo(tmp_path, cache, tiny):
    """``me/l``: a two-layer LorsaSet pushed as the Hub layout (with its card), cached at ``main``."""
    from nnsight_lorsa.formats.hub import set_card

    model, hf, adapter = tiny
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter, 1), 2: make_lorsa(hf, adapter, 2, seed=1)})
    src = tmp_path / "pushed"
    lorsas.save(src)
    set_card(src, kind="LorsaSet", what="Lorsa", key_name="layer",
             modules=[(k, lorsas.folder(k), lorsas[k]) for k in lorsas], config=hf.config, metrics_table="",
             repo_id="me/l", subfolder=None)
    return lorsas, src


def test_an_uncached_revision_is_named(cache, lorsa_repo, tiny):
    _, src = lorsa_repo
    cache.put("me/l", src)
    with pytest.raises(CheckpointError, match=r"'me/l'.*revision 'v2'"):
        LorsaSet.from_pretrained(tiny[0], "me/l", revision="v2")
    with pytest.raises(CheckpointError, match=r"'me/l'.*revision 'v2'.*subfolder 'layer_1'"):
        load("me/l", subfolder="layer_1", revision="v2")


@pytest.mark.parametrize("subfolder", ["/abs", "../models--me--other/snapshots", "a/../../b", "a/./.."])
def test_a_hub_subfolder_outside_the_repo_is_refused(tmp_path, cache, subfolder):
    """``snapshot / "/abs"`` is ``/abs``, and ``..`` climbs out of the snapshot: another repo's (or any) files
    would load as this repo's."""
    other = tmp_path / "other"
    save(make_sae(), other)
    cache.put("me/other", other)
    cache.put("me/sae", other, prefix="x")
    for source, kwargs in (("me/sae", {"subfolder": subfolder}), (f"me/sae:{subfolder}", {})):
        with pytest.raises(ArgumentError, match=r"'me/sae'.*subfolder"):
            load(source, **kwargs)
    abs_local = str(other)
    with pytest.raises(ArgumentError, match="subfolder"):
        load("me/sae", subfolder=abs_local)


def test_a_set_missing_a_folder_its_card_lists_is_refused(cache, lorsa_repo, tiny):
    """An interrupted download (or a cache copied in part) leaves a snapshot without some files; a huggingface_hub
    without the tree listing cache hands it over as it is. The set's card lists its folders: a folder it lists that
    the snapshot lacks, or that does not load, is an incomplete download, not a smaller set."""
    _, src = lorsa_repo
    layer_2 = ("layer_2/config.json", "layer_2/model.safetensors", "layer_2/checksums.json")
    cache.put("me/l", src, skip=layer_2)
    with pytest.raises(CheckpointError, match=r"'me/l'.*layer_2.*(incomplete|missing)"):
        LorsaSet.from_pretrained(tiny[0], "me/l")
    cache.put("me/m", src, skip=("layer_2/model.safetensors",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"'me/m'.*layer_2"):
            LorsaSet.from_pretrained(tiny[0], "me/m")
    cache.put("me/n", src)  # complete: loads
    assert LorsaSet.from_pretrained(tiny[0], "me/n").layers == [1, 2]
    # one folder of the set by subfolder: the card is not in it, nothing else is asked for
    assert LorsaSet.from_pretrained(tiny[0], "me/l:layer_1").layers == [1]


def test_a_missing_or_foreign_file_at_the_expected_name_is_named_and_never_unpickled(tmp_path, cache, monkeypatch):
    src = tmp_path / "sae"
    save(make_sae(), src)
    cache.put("me/nofile", src, skip=("model.safetensors",))
    with pytest.raises(LorsaError, match="model.safetensors"):
        load("me/nofile", format="nnsight_lorsa")
    pickled = tmp_path / "pickled"
    save(make_sae(), pickled)
    torch.save(make_sae().state_dict(), pickled / "model.safetensors")  # a torch pickle under the name
    (pickled / "checksums.json").unlink()
    cache.put("me/pickle", pickled)
    truncated = tmp_path / "truncated"
    save(make_sae(), truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cache.put("me/truncated", truncated)

    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    for repo in ("me/pickle", "me/truncated"):
        with pytest.raises(CheckpointError, match="model.safetensors"):
            load(repo)


@pytest.mark.parametrize("error", ["RepositoryNotFoundError", "RevisionNotFoundError", "EntryNotFoundError",
                                   "GatedRepoError", "LocalEntryNotFoundError", "OSError", "KeyboardInterrupt"])
def test_a_download_that_fails_midway_leaves_nothing_and_is_named(tmp_path, cache, monkeypatch, error):
    """``snapshot_download`` raising after it wrote part of a snapshot (huggingface_hub's own ``.incomplete``
    blobs): our error names the repo and revision; an interruption stays an interruption."""
    import huggingface_hub.errors as hf_errors

    src = tmp_path / "sae"
    save(make_sae(), src)

    def fail(repo_id, *, allow_patterns=None, revision=None, local_files_only=False, **kwargs):
        partial = cache.store(repo_id) / "blobs" / "deadbeef.incomplete"
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(b"\0" * 10)
        if error == "OSError":
            raise OSError("disk full")
        if error == "KeyboardInterrupt":
            raise KeyboardInterrupt
        e = getattr(hf_errors, error).__new__(getattr(hf_errors, error))  # no HTTP response to build one from
        Exception.__init__(e, f"404 Client Error: {error}")
        raise e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    if error == "KeyboardInterrupt":
        with pytest.raises(KeyboardInterrupt):
            load("me/fail", revision="r1")
        return
    with pytest.raises(CheckpointError, match=fr"'me/fail'.*revision 'r1'.*{error}"):
        load("me/fail", revision="r1")
    # nothing of ours in the cache: only huggingface_hub's own partial blob, which no snapshot links to
    assert cache.listing() == ["models--me--fail/blobs/deadbeef.incomplete"]


def test_load_model_refuses_the_meta_device():
    from nnsight_lorsa.envoy import load_model

    with pytest.raises(PlacementError, match="meta"):
        load_model(device="meta")


# ----------------------------------------------------------------------------------- release registry


REGISTRY_ENTRIES = {
    "saes: null": (CheckpointError, "'saes'"),
    "saes: {id: x}": (CheckpointError, "'saes'"),
    "saes:\n  - id: x\n    path: p\n    norm_scaling_factor: abc": (CheckpointError, "norm_scaling_factor"),
    "saes:\n  - id: x\n    path: p\n    norm_scaling_factor: [1]": (CheckpointError, "norm_scaling_factor"),
    "saes:\n  - id: x\n    path: ../../etc": (CheckpointError, "path"),
    "saes:\n  - id: x\n    path: /etc": (CheckpointError, "path"),
    "config_overrides: [1]\n  saes:\n  - id: x\n    path: p": (CheckpointError, "config_overrides"),
    "saes:\n  - id: [x]\n    path: p": (CheckpointError, "no sae_id 'x'"),
}


@pytest.mark.parametrize("body", sorted(REGISTRY_ENTRIES))
def test_a_malformed_release_entry_is_named(tmp_path, body):
    error, says = REGISTRY_ENTRIES[body]
    registry = tmp_path / "pretrained_saes.yaml"
    registry.write_text(f"r:\n  repo_id: a/b\n  {body}\n")
    with pytest.raises(error, match=says):
        resolve_release("r", "x", registry=registry)


@pytest.mark.parametrize(("release", "sae_id"), [(123, "x"), (None, "x"), ("r", ["x"]), ("r", None), ("r", 3)])
def test_release_names_that_are_not_strings_are_refused(tmp_path, release, sae_id):
    registry = tmp_path / "pretrained_saes.yaml"
    registry.write_text("r:\n  repo_id: a/b\n  saes:\n  - id: x\n    path: p\n")
    with pytest.raises(ArgumentError, match="str"):
        resolve_release(release, sae_id, registry=registry)


def test_a_transcoder_set_keeps_its_layers_through_the_cache(tmp_path, cache, tiny):
    model = tiny[0]
    from helpers import make_transcoders

    tcs = TranscoderSet(model, make_transcoders((0, 2)))
    tcs.save(tmp_path / "tcs")
    cache.put("me/tcs", tmp_path / "tcs", prefix="v/1")
    back = TranscoderSet.from_pretrained(model, "me/tcs", subfolder="v/1", local_files_only=True)
    assert list(back) == [0, 2]
    for k in back:
        assert_placed(back[k], tcs[k], "cpu", torch.float32, reference=tcs[k])


def test_a_revision_with_a_local_path_is_refused(tmp_path, cache, tiny):
    """A local directory wins over a repo id of the same spelling; a revision asked of it would be silently
    ignored (the files read would not be that revision's)."""
    from nnsight_lorsa import Graph

    save(make_sae(), tmp_path / "me" / "sae")
    os.chdir(tmp_path)
    with pytest.raises(ArgumentError, match=r"'me/sae' is a local path.*revision='v2'"):
        load("me/sae", revision="v2")
    assert load("me/sae").cfg.d_sae == 128  # without a revision: the local directory, as documented
    lorsas = LorsaSet(tiny[0], {1: make_lorsa(tiny[1], tiny[2], 1)})
    lorsas.save(tmp_path / "set")
    with pytest.raises(ArgumentError, match="revision"):
        LorsaSet.from_pretrained(tiny[0], tmp_path / "set", revision="v2")
    with pytest.raises(ArgumentError, match="revision"):
        Graph.load(tmp_path / "set", revision="v2")


# ----------------------------------------------------------------------------------- the peers' own files

PEERS = Path(__file__).resolve().parent.parent / "fixtures" / "peers"


def peer_checkpoints() -> list[str]:
    """Every folder of the peer fixtures (SAELens, sparsify, Llamascopium, circuit-tracer files written by the peers'
    own code) that holds a config (whether or not it loads: a refusal must be the same from the Hub)."""
    names = ("cfg.json", "config.json", "config.yaml")
    return sorted({p.parent.relative_to(PEERS).as_posix() for n in names for p in PEERS.rglob(n)
                   if "fields" not in p.relative_to(PEERS).parts})


def outcome(source, **kwargs):
    """``(module or None, error type name or None, warning categories)`` of ``load(source, **kwargs)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            module, error = load(source, **kwargs), None
        except LorsaError as e:
            module, error = None, type(e).__name__
    return module, error, sorted(type(w.message).__name__ for w in caught)


def check_peer_from_the_hub(tmp_path: Path, cache: Cache, rel: str) -> None:
    """The peer folder ``rel`` in a repo as an online download would leave it (only the files matching the patterns
    the load asks for: recorded on a full snapshot first), loaded by repo id, with ``format="auto"`` and with the
    detected format given: the local folder's outcome, bit for bit (its module, or its error and warnings)."""
    from nnsight_lorsa.errors import FormatDetectionError
    from nnsight_lorsa.formats import detect_format

    src = PEERS / rel
    try:
        formats = ["auto", detect_format(src)]
    except FormatDetectionError:
        formats = ["auto"]
    for n, fmt in enumerate(formats):
        check_peer_download(cache, rel, src, fmt, f"me/{n}-" + rel.replace("/", "-").replace("_", "-"))


def check_peer_download(cache: Cache, rel: str, src: Path, fmt: str, repo: str) -> None:
    prefix = f"peers/{rel}"  # the folder keeps its name (a sparsify hookpoint) and its parents' (checkpoints/step_N)
    cache.put(repo + "-all", src, prefix=prefix)
    first = len(cache.calls)
    outcome(repo + "-all", subfolder=prefix, format=fmt)
    patterns = [p for call in cache.calls[first:] for p in call["allow_patterns"]]
    files = files_under(src)
    fetched = set(filter_repo_objects([f"{prefix}/{f}" for f in files], allow_patterns=patterns))
    cache.put(repo, src, prefix=prefix, skip=tuple(f for f in files if f"{prefix}/{f}" not in fetched))
    hub, hub_error, hub_warnings = outcome(repo, subfolder=prefix, format=fmt)
    local, local_error, local_warnings = outcome(src, format=fmt)
    assert (hub_error, hub_warnings) == (local_error, local_warnings), (rel, fmt, sorted(fetched))
    if local is not None:  # a circuit-tracer set: each layer's transcoder
        hubs, locals_ = (getattr(m, "transcoders", {"": m}) for m in (hub, local))
        assert hubs.keys() == locals_.keys()
        for key, module in locals_.items():
            a, b = hubs[key].state_dict(), module.state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (rel, key)
            assert hubs[key].cfg == module.cfg


SAMPLE = ["saelens/trainer_standard_whitening/128", "saelens/trainer_topk_expected_average/128",
          "saelens/norm_expected_average_only_in", "sparsify/run/layers.0", "llamascopium/train_lorsa_output",
          "circuit_tracer/clt"]


@pytest.mark.parametrize("rel", [r for r in SAMPLE if r in peer_checkpoints()])
def test_a_peer_checkpoint_downloaded_is_its_local_folder(tmp_path, cache, rel):
    check_peer_from_the_hub(tmp_path, cache, rel)


@pytest.mark.slow
@pytest.mark.parametrize("rel", peer_checkpoints())
def test_every_peer_checkpoint_downloaded_is_its_local_folder(tmp_path, cache, rel):
    check_peer_from_the_hub(tmp_path, cache, rel)


def test_load_model_of_no_model_is_a_checkpoint_error(tmp_path, cache):
    from nnsight_lorsa.envoy import load_model

    (tmp_path / "empty").mkdir()
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text('{"model_type": "llama"}')
    for source in ("me/not-cached", tmp_path / "absent", tmp_path / "empty", tmp_path / "config-only"):
        with pytest.raises(CheckpointError, match=fr"load_model\('{source}'\): "):
            load_model(str(source))


def test_a_pushed_clt_set_comes_back_and_its_card_names_its_top(tmp_path, cache, tiny, monkeypatch):
    """A CLT set is saved at the top of its folder: its card listed a ``clt/`` folder that no push writes, which
    the card check would have read as an incomplete download of any set loaded from the repo."""
    from helpers import make_clt

    from nnsight_lorsa import CLTSet
    from nnsight_lorsa.errors import ConfigMismatchError
    from nnsight_lorsa.formats import hub

    published = tmp_path / "published"
    monkeypatch.setattr(hub, "push_folder", lambda folder, repo_id, **kwargs: str(shutil.copytree(folder, published)))
    clts = CLTSet(tiny[0], make_clt())
    clts.push_to_hub("me/clt")
    assert "| clt | `./` | CrossLayerTranscoder |" in (published / "README.md").read_text()
    cache.put("me/clt", published)
    back = CLTSet.from_pretrained(tiny[0], "me/clt", dtype=torch.float32)
    a, b = back.clt.state_dict(), clts.clt.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigMismatchError, match="CrossLayerTranscoder"):
        TranscoderSet.from_pretrained(tiny[0], "me/clt")


# ----------------------------------------------------------------------------------- generated sources

PART = st.text(alphabet="ab-_.:/\\ \x00é*?~", max_size=12)
SOURCES = st.one_of(st.text(max_size=20), st.builds(lambda a, b, c: f"{a}/{b}{c}", PART, PART, PART),
                    st.sampled_from(["", ".", "..", "/", "./", "me/x:", "me/x:.", "me/x:..", "me--x/y", "me/x/y"]))


def check_source(model, loader: str, source: str, subfolder, revision) -> None:
    """Every source string, subfolder and revision ends in a named error (nothing cached, nothing local)."""
    from nnsight_lorsa import Graph

    with pytest.raises(LorsaError):
        if loader == "load":
            load(source, subfolder=subfolder, revision=revision)
        elif loader == "graph":
            Graph.load(source, subfolder=subfolder, revision=revision)
        else:
            LorsaSet.from_pretrained(model, source, subfolder=subfolder, revision=revision)


@probe(40)
@given(loader=st.sampled_from(["load", "graph", "set"]), source=SOURCES, subfolder=st.one_of(st.none(), PART),
       revision=st.one_of(st.none(), PART))
@example(loader="load", source="", subfolder=None, revision=None)  # Path("").with_name: a ValueError
@example(loader="set", source="/", subfolder=None, revision=None)
def test_every_source_string_ends_in_a_named_error(cache, tiny, loader, source, subfolder, revision):
    check_source(tiny[0], loader, source, subfolder, revision)


@pytest.mark.slow
@probe(2000)
@given(loader=st.sampled_from(["load", "graph", "set"]), source=SOURCES, subfolder=st.one_of(st.none(), PART),
       revision=st.one_of(st.none(), PART))
def test_every_source_string_ends_in_a_named_error_sweep(cache, tiny, loader, source, subfolder, revision):
    check_source(tiny[0], loader, source, subfolder, revision)
