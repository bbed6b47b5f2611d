"""On-disk activation cache: one pass over the model, several dictionaries trained from it.

:func:`write_activation_cache` runs ``model.trace`` once per batch of windows of a
:class:`~.activations.TokenDataset` and records the values of several :class:`~..envoy.read.Site` s
(e.g. the MLP input and output of every layer and a residual stream; read by
:func:`~..envoy.read.read_sites`) into safetensors shards::

    <dir>/manifest.json                 format, version, model name + config hash, dataset hash,
                                        seq_len, n_windows, n_tokens, n_loss_tokens, dtype, has_target_mask,
                                        sites {name: {path, kind, d}}, shards [{file, start, n_windows}]
    <dir>/shard_00000.safetensors       per window: "<site name>" (n, seq_len, d) for every site,
                                        "input_ids" (n, seq_len) int64, "loss_mask" (n, seq_len) bool,
                                        "target_mask" (n, seq_len) bool (the dataset's; all True without one)

Version 2 stores the dataset's ``target_mask`` (``has_target_mask``: whether it had one), so
:meth:`ActivationCache.dataset` gives back the windows and their mask. Version 1 caches (no
``target_mask``) load and read as before; their :meth:`~ActivationCache.dataset` is the ids alone where
nothing was masked (``loss_mask`` all True past BOS) and an :class:`~..errors.ActivationCacheError`
otherwise (``loss_mask`` has column 0 False whatever the mask held there: the mask cannot be recovered).

The write is atomic (:func:`nnsight_lorsa._atomic.atomic_directory`): the shards and the manifest are
staged in a sibling directory with a ``checksums.json`` (every file's size and sha256) and swapped in
at the end, so a killed run leaves no half-written cache. :class:`ActivationCache` checks every
file's size and the manifest's sha256 when it opens the directory, and a shard's sha256 when its
first window is read.

What a load refuses (:class:`~..errors.ActivationCacheError`, naming the file): a manifest field of
the wrong type; a shard path that is absolute, has a ``..`` part or leads outside the directory
(``formats.validate.check_member_file``); a shard listed twice; shards whose ``input_ids``, in
manifest order, do not hash to the manifest's ``dataset_hash`` (and, per shard, to its own
``tokens_sha256``: the swapped or foreign shard is named) — all when the cache is opened; and, when a
shard's first window is read (or at :meth:`ActivationCache.verify`), a shard whose sha256 differs
from ``checksums.json`` or from the manifest's own per-shard ``sha256`` (edited values, a shard
copied from a cache of the same windows), or one holding NaN/inf. The write refuses non-finite
activations. Caches written before the per-shard hashes existed load as before (their dataset hash,
checksums and finiteness are still checked).

Nothing is pickled (JSON + safetensors only). :class:`ActivationCache` opens a directory and
checks the manifest against the shards (and against a model, sites and widths if given);
``ActivationSource(cache, x, y, batch_size=…, seed=…)`` (:class:`~.activations.ActivationSource`)
then yields batch ``i`` equal to what the live source with these arguments computes (the same
seeded window permutation per epoch, the same values), so the trainer consumes either and training
from the cache gives the same dictionary as training live. Shards are memory-mapped and read
window by window.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .._atomic import MANIFEST as ATOMIC_MANIFEST
from .._atomic import Staging, atomic_directory, check, manifest_of, resolve, verify_file
from .._checks import is_int
from .._placement import model_device
from .._progress import show_progress
from .._typing import Int
from ..envoy.nnsight_internals import check_traceable, hf_module
from ..envoy.read import Site, read_sites
from ..errors import ActivationCacheError, ArgumentError, CheckpointError
from ..formats.files import check_path, read_json_object
from ..formats.validate import check_member_file
from .dataset import TokenDataset, _loss_mask, check_dataset_ids

FORMAT = "nnsight-lorsa-activation-cache"
VERSION = 2
#: versions a cache is read at: 1 (before ``target_mask`` was stored) and :data:`VERSION`
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64}


def site_name(site: Site) -> str:
    """The default cache name of a site: ``"<path>:<kind>"`` (e.g. ``"model.layers.1.mlp:input"``)."""
    return f"{site.path}:{site.kind}"


def _weights_hash(hf: Any) -> str:
    """SHA-256 over every parameter's name, shape, dtype and up to 4096 evenly strided values ("" when a
    parameter is not materialised, e.g. on the meta device of a model not yet dispatched)."""
    named = getattr(hf, "named_parameters", None)
    if named is None:
        return ""
    h = hashlib.sha256()
    for name, p in named():
        if p.is_meta:
            return ""
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(flat[::step].to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()


def _config_hashes(config: Any) -> tuple[str, str]:
    """``(hash, legacy hash)`` of a transformers config: SHA-256 of its JSON with sorted keys
    (``to_json_string(use_diff=False)``) without ``_name_or_path``, and with it (as caches written by
    0.x before the path was dropped recorded it)."""
    legacy = config.to_json_string(use_diff=False)
    d = json.loads(legacy)
    d.pop("_name_or_path", None)
    text = json.dumps(d, indent=2, sort_keys=True) + "\n"
    return hashlib.sha256(text.encode()).hexdigest(), hashlib.sha256(legacy.encode()).hexdigest()


def model_fingerprint(model: Any) -> dict[str, str]:
    """``{"name", "config_hash", "weights_hash"}`` of an nnsight (or HF) model: ``name_or_path``
    (informative), the SHA-256 of its config without the path (:func:`_config_hashes`) and of a strided
    sample of its weights (:func:`_weights_hash`; tells a retrained or other checkpoint with the same
    config apart, not one edited weight)."""
    hf = hf_module(model)
    config = getattr(hf, "config", None)
    if config is None:
        return {"name": type(hf).__name__, "config_hash": "", "weights_hash": _weights_hash(hf)}
    return {"name": str(getattr(config, "_name_or_path", "") or type(hf).__name__),
            "config_hash": _config_hashes(config)[0], "weights_hash": _weights_hash(hf)}


def tokens_hash(tokens: torch.Tensor) -> str:
    """SHA-256 of a token tensor's int64 bytes and shape (identifies the dataset a cache was written from)."""
    t = tokens.to("cpu", torch.int64).contiguous()
    h = hashlib.sha256(str(tuple(t.shape)).encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def _ids_sha256(ids: torch.Tensor) -> str:
    """SHA-256 of one shard's ``input_ids`` bytes (int64, row-major): the shard's part of the dataset hash."""
    return hashlib.sha256(ids.to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _normalise_sites(sites: Mapping[str, Site] | Iterable[Site]) -> dict[str, Site]:
    if isinstance(sites, (str, Site)) or not isinstance(sites, (Mapping, Iterable)):
        raise ArgumentError(f"write_activation_cache(sites=...) must be a list of Sites or a mapping {{name: Site}}, "
                            f"got a {type(sites).__name__} (e.g. [Site.mlp_input(adapter, layer)])")
    named = dict(sites) if isinstance(sites, Mapping) else {site_name(s) if isinstance(s, Site) else repr(s): s
                                                            for s in sites}
    odd = [name for name, s in named.items() if not isinstance(s, Site)]
    if odd:
        raise ArgumentError(f"write_activation_cache(sites=...): {odd[:3]} are not Sites (Site.mlp_input(adapter, "
                            "layer), Site.resid_post(...), ...)")
    if not named:
        raise ActivationCacheError("write_activation_cache needs at least one site")
    for name, s in named.items():
        if not isinstance(s, Site):
            raise ActivationCacheError(f"site {name!r} is {type(s).__name__}, not a Site")
        if name in ("input_ids", "loss_mask", "target_mask"):
            raise ActivationCacheError(f"site name {name!r} is reserved")
        if s.kind == "positions":
            raise ActivationCacheError(f"site {name!r}: positions are not cached (only inputs and outputs)")
    return named


@torch.no_grad()
def write_activation_cache(model: Any, sites: Mapping[str, Site] | Iterable[Site], dataset: TokenDataset,
                           directory: str | Path, *, batch_size: int = 16, windows_per_shard: int = 256,
                           dtype: torch.dtype | None = None, progress: bool | None = None) -> ActivationCache:
    """Record ``sites`` on every window of ``dataset`` (in order) with one trace per batch; return the cache.

    Args:
        model: nnsight-wrapped model. sites: ``{name: Site}`` or Sites (named by :func:`site_name`).
        dataset: the windows (``[BOS] + …``, as for :class:`~.activations.ActivationSource`).
        directory: created (atomically, when complete) if needed; must not hold a cache already.
        batch_size: windows per trace. windows_per_shard: windows per safetensors file.
        dtype: storage dtype of the activations; default (None) the model's widened to at least float32, which
            keeps the cached stream bit-equal to the live one: float32 for an fp32 / bf16 / fp16 model (an exact
            widening), float64 for an fp64 model. A narrower dtype (e.g. bfloat16) rounds the stream as asked.
        progress: a tqdm bar over the windows; None (default): when stderr is a terminal.

    Devices: the model runs where it is (each batch of windows is moved to its device); the
    activations are copied to the CPU and written there, and the cache reads back CPU tensors.

    Raises:
        ActivationCacheError: no sites, a reserved or unknown site, ``directory`` already holds a cache, or
            ``batch_size`` / ``windows_per_shard`` not positive ints.
        ArgumentError: ``sites`` not Sites (a str, a list holding something else), ``dataset`` not a
            :class:`~.dataset.TokenDataset`, ``directory`` not a str / ``os.PathLike``, ``model`` not an nnsight
            model, a dataset holding an id outside the model's vocabulary or windows longer than its learned
            positions (:func:`~.dataset.check_dataset_ids`) — before the model runs.

    Source: ours (this package's on-disk activation cache format).
    """
    named = _normalise_sites(sites)
    if not isinstance(dataset, TokenDataset):
        raise ArgumentError(f"write_activation_cache(dataset=...) must be a TokenDataset, got a "
                            f"{type(dataset).__name__} (TokenDataset(tokens) for a tensor of windows)")
    check_path(directory, "write_activation_cache", "a directory")
    check_traceable(model, "write_activation_cache")
    check_dataset_ids(dataset, model, "write_activation_cache")
    device = model_device(model)
    if dtype is None:
        dtype = torch.promote_types(next(p for p in hf_module(model).parameters() if p.is_floating_point()).dtype,
                                    torch.float32)
    if not (is_int(batch_size) and is_int(windows_per_shard)) or batch_size <= 0 or windows_per_shard <= 0:
        raise ActivationCacheError(f"batch_size and windows_per_shard must be positive ints, got {batch_size!r} and "
                                   f"{windows_per_shard!r}")
    dtype_name = next((k for k, v in _DTYPES.items() if v == dtype), None)
    if dtype_name is None:
        raise ActivationCacheError(f"unsupported cache dtype {dtype}; use one of {list(_DTYPES)}")
    d = Path(directory)
    if (resolve(d) / MANIFEST).exists():
        raise ActivationCacheError(f"{resolve(d) / MANIFEST} exists: a cache is already written there")
    with atomic_directory(d) as stage:
        _write_shards(stage, model, named, dataset, device, batch_size, windows_per_shard, dtype, dtype_name,
                      show_progress(progress))
    return ActivationCache(d)


def _write_shards(stage: Staging, model: Any, named: dict[str, Site], dataset: TokenDataset, device: Any,
                  batch_size: int, windows_per_shard: int, dtype: torch.dtype, dtype_name: str,
                  progress: bool = False) -> None:
    """The shards and the manifest of :func:`write_activation_cache`, into the staging directory."""
    tokens = dataset.tokens
    widths: dict[str, int] = {}
    shards: list[dict[str, Any]] = []
    pending: dict[str, list[torch.Tensor]] = {}
    pending_n = 0
    n_loss = 0

    def flush(start: int) -> None:
        nonlocal pending, pending_n
        if pending_n == 0:
            return
        name = f"shard_{len(shards):05d}.safetensors"
        tensors = {k: torch.cat(v).contiguous() for k, v in pending.items()}
        stage.save_tensors(name, tensors)
        shards.append({"file": name, "start": start, "n_windows": pending_n,
                       "sha256": stage.files[name]["sha256"], "tokens_sha256": _ids_sha256(tensors["input_ids"])})
        pending, pending_n = {}, 0

    shard_start = 0
    bar = tqdm(total=len(dataset), desc="activation cache", unit="window", disable=not progress, dynamic_ncols=True)
    for start in range(0, len(dataset), batch_size):
        ids = tokens[start:start + batch_size]
        values = read_sites(model, named, ids.to(device))
        targets = dataset.targets(start, start + batch_size)
        mask = _loss_mask(ids, targets)
        n_loss += int(mask.sum())
        for name, v in values.items():
            widths.setdefault(name, int(v.shape[-1]))
            bad = int((~torch.isfinite(v.detach().to("cpu", dtype))).sum())
            if bad:
                raise ActivationCacheError(f"site {name!r} has {bad} non-finite values (NaN/inf) in windows "
                                           f"{start}..{start + ids.shape[0] - 1} (as {dtype_name}); nothing written")
            pending.setdefault(name, []).append(v.detach().to("cpu", dtype))
        pending.setdefault("input_ids", []).append(ids.to("cpu", torch.int64))
        pending.setdefault("loss_mask", []).append(mask)
        pending.setdefault("target_mask", []).append(
            torch.ones_like(mask) if targets is None else targets.to("cpu", torch.bool))
        pending_n += ids.shape[0]
        bar.update(ids.shape[0])
        if pending_n >= windows_per_shard:
            flush(shard_start)
            shard_start = start + ids.shape[0]
    flush(shard_start)
    bar.close()
    manifest = {
        "format": FORMAT, "version": VERSION, "model": model_fingerprint(model),
        "dataset_hash": tokens_hash(tokens), "seq_len": dataset.seq_len, "n_windows": len(dataset),
        "n_tokens": len(dataset) * dataset.seq_len, "n_loss_tokens": n_loss, "dtype": dtype_name,
        "has_target_mask": dataset.target_mask is not None,
        "sites": {name: {"path": s.path, "kind": s.kind, "d": widths[name]} for name, s in named.items()},
        "shards": shards,
    }
    stage.write_text(MANIFEST, json.dumps(manifest, indent=1))


class ActivationCache:
    """A cache written by :func:`write_activation_cache` (read-only, memory-mapped shards).

    ``ActivationCache(directory, model=None, sites=None, d=None)``: with ``model`` the manifest's
    model name and config hash must match it; ``sites`` (names or Sites) must all be cached; ``d``
    (``{name: width}``) must match the cached widths.

    Raises:
        ActivationCacheError: no manifest, wrong format/version, a shard missing or disagreeing
            with the manifest (file and key named), or any of the checks above failing.
        ArgumentError: ``directory`` not a str / ``os.PathLike``; ``sites`` not None or a list, ``d`` not None or a
            mapping.

    Source: ours (this package's on-disk activation cache format).
    """

    def __init__(self, directory: str | Path, *, model: Any = None, sites: Iterable[str | Site] | None = None,
                 d: Mapping[str, int] | None = None) -> None:
        check_path(directory, "ActivationCache", "a cache directory")
        self.directory = resolve(directory)  # `<directory>.old` when a write was killed between its renames
        try:
            self._checksums = manifest_of(self.directory) or {}
        except CheckpointError as e:
            raise ActivationCacheError(str(e)) from e
        self._hashed: set[str] = set()
        self._content_checked: set[str] = set()
        path = self.directory / MANIFEST
        if not path.is_file():
            raise ActivationCacheError(f"{path}: no activation-cache manifest")
        try:  # the one JSON reader of the file formats: missing, unreadable, not UTF-8, not JSON, not an object
            self.manifest: dict[str, Any] = read_json_object(path)
        except CheckpointError as e:
            raise ActivationCacheError(f"{e} (not a {FORMAT} manifest)") from e
        m = self.manifest
        if m.get("format") != FORMAT or m.get("version") not in READABLE_VERSIONS or isinstance(m.get("version"),
                                                                                                  bool):
            raise ActivationCacheError(f"{path}: not a {FORMAT} manifest of version "
                                       f"{' or '.join(map(str, READABLE_VERSIONS))} "
                                       f"(format {m.get('format')!r}, version {m.get('version')!r})")
        self._handles: dict[str, Any] = {}
        try:
            self._check_manifest_fields(path)
            # every present shard's size (a torn shard) before it is opened; the manifest's own checks, and
            # its own message for a missing shard, come first
            self._verify([f for f in self._checksums if f != MANIFEST and (self.directory / f).is_file()],
                         hashes=False)
            self._check_shards()
            self._check_windows()
        except ActivationCacheError as e:
            self._blame_the_manifest(e)
            raise
        self._starts = torch.tensor([s["start"] for s in m["shards"]], dtype=torch.long, device="cpu")
        if model is not None:
            self.check_model(model)
        if sites is not None and (isinstance(sites, (str, bytes, Site)) or not isinstance(sites, Iterable)):
            raise ArgumentError(f"ActivationCache: sites must be None or a list of site names / Sites, got {sites!r}")
        if d is not None and not isinstance(d, Mapping):
            raise ArgumentError(f"ActivationCache: d must be None or a mapping {{site name: width}}, got {d!r}")
        for s in sites or ():
            self.site(s)
        for name, width in (d or {}).items():
            if self.width(name) != width:
                raise ActivationCacheError(f"{path}: site {name!r} is cached with d={self.width(name)}, "
                                           f"expected d={width}")
        self._verify(list(self._checksums), hashes=False)  # every listed file is there, at its size
        self._verify([MANIFEST])  # the manifest's sha256; a shard's when its first window is read

    def _blame_the_manifest(self, error: ActivationCacheError) -> None:
        """Where ``error`` came from a field of the manifest and the manifest itself fails its checksum (a
        damaged byte turned a shard's name, range or shape into another one), raise an error that says so,
        naming the manifest first: otherwise the shard it now points at would take the blame."""
        if MANIFEST not in self._checksums:
            return
        try:
            self._verify([MANIFEST])
        except ActivationCacheError as damaged:
            raise ActivationCacheError(f"{damaged} — so the manifest's fields cannot be trusted: {error}") from error

    def _check_manifest_fields(self, path: Path) -> None:
        """The manifest's fields have their types, and every shard file lies inside the cache directory."""
        m = self.manifest
        for key in ("seq_len", "n_windows"):
            if not isinstance(m.get(key), int) or isinstance(m.get(key), bool) or m[key] < 0:
                raise ActivationCacheError(f"{path}: key {key!r} must be an int >= 0, got {m.get(key)!r}")
        if m["version"] >= 2 and not isinstance(m.get("has_target_mask"), bool):
            raise ActivationCacheError(f"{path}: key 'has_target_mask' must be true or false, got "
                                       f"{m.get('has_target_mask')!r}")
        if not isinstance(m.get("dataset_hash"), str):
            raise ActivationCacheError(f"{path}: key 'dataset_hash' must be a string, got {m.get('dataset_hash')!r}")
        if not isinstance(m.get("model"), dict):
            raise ActivationCacheError(f"{path}: key 'model' must be a mapping, got {m.get('model')!r}")
        sites = m.get("sites")
        if not isinstance(sites, dict) or not sites:
            raise ActivationCacheError(f"{path}: key 'sites' must be a non-empty mapping, got {sites!r}")
        for name, v in sites.items():
            if (not isinstance(v, dict) or not isinstance(v.get("path"), str)
                    or v.get("kind") not in ("input", "output") or not isinstance(v.get("d"), int)
                    or isinstance(v.get("d"), bool) or v["d"] <= 0):
                raise ActivationCacheError(f"{path}: key 'sites'[{name!r}] must be {{path: str, kind: 'input' | "
                                           f"'output', d: int > 0}}, got {v!r}")
        shards = m.get("shards")
        if not isinstance(shards, list):
            raise ActivationCacheError(f"{path}: key 'shards' must be a list, got {shards!r}")
        seen: set[str] = set()
        for i, shard in enumerate(shards):
            where = f"shards[{i}]"
            if not isinstance(shard, dict):
                raise ActivationCacheError(f"{path}: key {where!r} must be a mapping, got {shard!r}")
            check_member_file(self.directory, shard.get("file"), path, f"{where}.file", ActivationCacheError)
            if shard["file"] in seen or shard["file"] in (MANIFEST, ATOMIC_MANIFEST):
                raise ActivationCacheError(f"{path}: key '{where}.file' lists {shard['file']!r} twice (or a manifest)")
            seen.add(shard["file"])
            for key in ("start", "n_windows"):
                value = shard.get(key)
                if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "n_windows" else 0):
                    raise ActivationCacheError(f"{path}: key '{where}.{key}' must be an int >= "
                                               f"{1 if key == 'n_windows' else 0}, got {value!r}")
            for key in ("sha256", "tokens_sha256"):
                if key in shard and not (isinstance(shard[key], str) and len(shard[key]) == 64):
                    raise ActivationCacheError(f"{path}: key '{where}.{key}' must be a sha256 hex string, "
                                               f"got {shard[key]!r}")

    def _check_windows(self) -> None:
        """Every shard's ``input_ids``, in manifest order, against the manifest's ``dataset_hash`` (and each
        against its own ``tokens_sha256``, naming the shard): a swapped shard, or one copied from a cache of
        other windows, is refused when the cache is opened."""
        m = self.manifest
        whole = hashlib.sha256(str((m["n_windows"], m["seq_len"])).encode())
        for shard in m["shards"]:
            ids = self._handle(shard["file"]).get_tensor("input_ids")
            if ids.dtype != torch.int64:
                raise ActivationCacheError(f"{self.directory / shard['file']}: tensor 'input_ids' has dtype "
                                           f"{ids.dtype}, expected torch.int64")
            raw = ids.contiguous().numpy().tobytes()
            want = shard.get("tokens_sha256")
            if want is not None and hashlib.sha256(raw).hexdigest() != want:
                last = shard["start"] + shard["n_windows"] - 1
                raise ActivationCacheError(f"{self.directory / shard['file']}: its windows are not the ones the "
                                           f"manifest lists at windows {shard['start']}..{last} "
                                           "(a shard swapped, or copied from another cache)")
            whole.update(raw)
        if whole.hexdigest() != m["dataset_hash"]:
            raise ActivationCacheError(f"{self.directory / MANIFEST}: the shards' windows, in manifest order "
                                       f"({[s['file'] for s in m['shards']]}), do not hash to the manifest's "
                                       "dataset_hash (shards swapped, or copied from another cache)")

    def _check_shard_content(self, file: str) -> None:
        """A shard's sha256 (``checksums.json`` and the manifest's own entry) and finite activations;
        once per shard, when its first window is read (or by :meth:`verify`)."""
        self._verify([file])
        shard = next(s for s in self.manifest["shards"] if s["file"] == file)
        want = shard.get("sha256")
        if want is not None:
            try:
                verify_file(self.directory, file, (self.directory / file).stat().st_size, want, MANIFEST,
                            optional=False)
            except CheckpointError as e:
                raise ActivationCacheError(f"{e} (the shard's sha256 in {MANIFEST}: a shard edited, swapped or "
                                           "copied from another cache)") from e
        h = self._handle(file)
        for key in self.manifest["sites"]:
            view = h.get_slice(key)
            n = shard["n_windows"]
            for row in range(0, n, 64):
                part = view[row:min(n, row + 64)]
                bad = int((~torch.isfinite(part)).sum())
                if bad:
                    raise ActivationCacheError(f"{self.directory / file}: tensor {key!r} has {bad} non-finite "
                                               f"values (NaN/inf) in windows {shard['start'] + row}.."
                                               f"{shard['start'] + min(n, row + 64) - 1}")
        self._content_checked.add(file)

    def verify(self) -> None:
        """Check every shard now (sha256, finite values) instead of at its first read.

        Raises:
            ActivationCacheError: a shard altered, swapped, copied from another cache or holding NaN/inf
                (naming the file).

        Source: ours (this package's on-disk activation cache format).
        """
        for shard in self.manifest["shards"]:
            if shard["file"] not in self._content_checked:
                self._check_shard_content(shard["file"])

    def _verify(self, files: list[str], hashes: bool = True) -> None:
        """Check ``files`` against ``checksums.json`` (when the cache has one; sha256 once per file)."""
        todo = {f: self._checksums[f] for f in files if f in self._checksums and (not hashes or f not in self._hashed)}
        try:
            check(self.directory, todo, hashes=hashes)
        except CheckpointError as e:
            raise ActivationCacheError(str(e)) from e
        if hashes:
            self._hashed.update(files)

    # ------------------------------------------------------------ metadata
    @property
    def n_windows(self) -> int:
        """Number of windows in the cache (from the manifest).

        Source: ours (this package's on-disk activation cache format).
        """
        return int(self.manifest["n_windows"])

    @property
    def seq_len(self) -> int:
        """Tokens per window (from the manifest).

        Source: ours (this package's on-disk activation cache format).
        """
        return int(self.manifest["seq_len"])

    @property
    def sites(self) -> dict[str, Site]:
        """``{name: Site}`` of the cached sites.

        Source: ours (this package's on-disk activation cache format).
        """
        return {n: Site(v["path"], v["kind"]) for n, v in self.manifest["sites"].items()}

    def site(self, site: str | Site) -> str:
        """The cache name of ``site`` (a name or a :class:`~..envoy.read.Site`).

        Raises:
            ActivationCacheError: the site is not in the cache.

        Source: ours (this package's on-disk activation cache format).
        """
        sites = self.sites
        if isinstance(site, Site):
            for name, s in sites.items():
                if s == site:
                    return name
        elif site in sites:
            return site
        raise ActivationCacheError(f"{self.directory / MANIFEST}: site {site!r} is not cached; cached: {list(sites)}")

    def width(self, site: str | Site) -> int:
        """The last-dim width ``d`` of a cached site.

        Source: ours (this package's on-disk activation cache format).
        """
        return int(self.manifest["sites"][self.site(site)]["d"])

    def check_model(self, model: Any) -> None:
        """Raise :class:`ActivationCacheError` unless the cache was written from ``model``: same config
        hash, and same weights hash where both sides have one (a cache written before weights were
        hashed, or a model whose weights are not materialised, is checked by its config only). The
        name (``name_or_path``) is informative: the same model loaded from another folder passes.

        Source: ours (this package's on-disk activation cache format).
        """
        want, have = self.manifest["model"], model_fingerprint(model)
        w_want, w_have = want.get("weights_hash", ""), have["weights_hash"]
        config = getattr(hf_module(model), "config", None)
        same_config = want.get("config_hash") == have["config_hash"] or (
            config is not None and want.get("config_hash") == _config_hashes(config)[1])
        if not same_config or (w_want and w_have and w_want != w_have):
            what = "configs" if not same_config else "weights"
            raise ActivationCacheError(f"{self.directory / MANIFEST}: written from model {want.get('name')!r} "
                                       f"(config {str(want.get('config_hash'))[:12]}, weights {w_want[:12] or '?'}), "
                                       f"not from {have['name']!r} (config {have['config_hash'][:12]}, weights "
                                       f"{w_have[:12] or '?'}): their {what} differ")

    def check_dataset(self, dataset: TokenDataset) -> None:
        """Raise :class:`ActivationCacheError` unless the cache holds exactly ``dataset``'s windows.

        Source: ours (this package's on-disk activation cache format).
        """
        if tokens_hash(dataset.tokens) != self.manifest["dataset_hash"]:
            raise ActivationCacheError(f"{self.directory / MANIFEST}: written from a different token dataset")

    def _check_shards(self) -> None:
        m = self.manifest
        expected = 0
        for shard in m["shards"]:
            path = self.directory / shard["file"]
            if not path.is_file():
                raise ActivationCacheError(f"{path}: shard listed in the manifest is missing")
            if shard["start"] != expected:
                raise ActivationCacheError(f"{path}: starts at window {shard['start']}, expected {expected}")
            expected += shard["n_windows"]
            h = self._handle(shard["file"])
            keys = set(h.keys())
            n, s = shard["n_windows"], m["seq_len"]
            want = {name: [n, s, v["d"]] for name, v in m["sites"].items()}
            want.update(input_ids=[n, s], loss_mask=[n, s])
            if m["version"] >= 2:
                want.update(target_mask=[n, s])
            for key, shape in want.items():
                if key not in keys:
                    raise ActivationCacheError(f"{path}: missing tensor {key!r}")
                got = list(h.get_slice(key).get_shape())
                if got != shape:
                    raise ActivationCacheError(f"{path}: tensor {key!r} has shape {got}, manifest says {shape}")
        if expected != m["n_windows"]:
            raise ActivationCacheError(f"{self.directory / MANIFEST}: shards hold {expected} windows, "
                                       f"manifest says {m['n_windows']}")

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.directory / file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for a corrupt header
                raise ActivationCacheError(f"{self.directory / file}: not a readable safetensors shard "
                                           f"({type(e).__name__}: {e})") from e
        return self._handles[file]

    # ------------------------------------------------------------ reading
    def windows(self, key: str, index: Int[torch.Tensor, " n"]) -> torch.Tensor:
        """Tensor ``key`` (a site name, ``"input_ids"``, ``"loss_mask"`` or — version 2 — ``"target_mask"``) of
        windows ``index``, in that order.

        Source: ours (this package's on-disk activation cache format).
        """
        shard_of = torch.searchsorted(self._starts, index, right=True) - 1
        parts = []
        for w, s in zip(index.tolist(), shard_of.tolist(), strict=True):
            shard = self.manifest["shards"][s]
            if shard["file"] not in self._content_checked:
                self._check_shard_content(shard["file"])
            row = w - shard["start"]
            parts.append(self._handle(shard["file"]).get_slice(key)[row:row + 1])
        return torch.cat(parts)

    def dataset(self) -> TokenDataset:
        """The cached windows as a :class:`~.activations.TokenDataset`: their token ids and the ``target_mask``
        the dataset written had (None where it had none). The mask is not checked again (a part of a dataset,
        e.g. of ``split``, is written as it is), only against the cached ``loss_mask``.

        Raises:
            ActivationCacheError: a version 1 cache whose ``loss_mask`` leaves out a position past BOS (its
                ``target_mask`` was not stored and cannot be recovered: write the cache again, or keep the
                dataset it was written from: :meth:`check_dataset`); a stored ``target_mask`` that does not give
                the cached ``loss_mask`` (the file altered).

        Source: ours (this package's on-disk activation cache format).
        """
        every = torch.arange(self.n_windows, device="cpu")
        data = TokenDataset(self.windows("input_ids", every))
        loss = self.windows("loss_mask", every).bool()
        if self.manifest["version"] < 2:
            if bool(loss[:, 1:].all()):
                return data
            rows = (~loss[:, 1:]).any(dim=1).nonzero().flatten().tolist()
            raise ActivationCacheError(
                f"{self.directory / MANIFEST}: a version 1 cache, written before the dataset's target_mask was "
                f"stored, and its loss_mask leaves out positions of windows {rows[:8]}{' …' if len(rows) > 8 else ''}"
                ": the target_mask cannot be recovered (column 0 of loss_mask is always False). Write the cache "
                "again, or use the TokenDataset it was written from (cache.check_dataset(dataset) checks it)")
        if not self.manifest["has_target_mask"]:
            return data
        target = self.windows("target_mask", every).bool()
        if not torch.equal(_loss_mask(data.tokens, target), loss):
            raise ActivationCacheError(f"{self.directory / MANIFEST}: the shards' target_mask does not give their "
                                       "loss_mask (a shard altered)")
        data.target_mask = target  # checked when it was written; a split's part is not checked alone
        return data
