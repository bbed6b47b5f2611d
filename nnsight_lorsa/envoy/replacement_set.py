"""``ReplacementSet``: replacement modules of one nnsight model, keyed by where they go.

The one contract of every replacement kind — :class:`~.lorsa_set.LorsaSet` and
:class:`~.transcoder_set.TranscoderSet` (keyed by layer), :class:`~.sae_set.SAESet` (keyed by site
path), :class:`~.clt_set.CLTSet` (one key, ``"clt"``): a read-only mapping checked on insertion
(:attr:`~ReplacementSet.module_type`, :meth:`~ReplacementSet.check`), ``replace(key=None, error=False)``
that splices one, several or all of them into the current trace (:meth:`~ReplacementSet.site`: the
splice chain), the width :meth:`~ReplacementSet.n_latents`, placement (:meth:`~ReplacementSet.place`,
:attr:`~ReplacementSet.offload`),
copy / cast (:meth:`~ReplacementSet.subset`), ``save`` / ``from_pretrained``, and the bundle's hooks
(:attr:`~ReplacementSet.slot`, :meth:`~ReplacementSet.feature_module`, :meth:`~ReplacementSet.envoys`).
Callers (the bundle, ``evaluate``, ``remote``) use these and never branch on the kind.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from .._checks import check_flag, is_collection, is_int, refuse_training_space
from .._placement import (
    check_one_dtype,
    check_placement_args,
    kept_on_failure,
    offloaded,
    place,
    set_offload,
    store_on_host,
)
from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import adapter_for
from ..errors import ArgumentError, ConfigMismatchError, PlacementError
from .nnsight_internals import hf_module
from .splice_chain import SpliceChain, splice_chain

K = TypeVar("K")
M = TypeVar("M", bound=nn.Module)


def _one_key(key: Any, key_type: type, what: str) -> Any:
    if key_type is int:
        if isinstance(key, (bool, float, str, bytes)) or getattr(key, "ndim", 0) != 0:
            raise ArgumentError(f"{what} must be an int layer index, got {key!r} ({type(key).__name__})")
        try:
            return operator.index(key)  # ints, numpy integers, 0-d integer tensors
        except TypeError:
            raise ArgumentError(f"{what} must be an int layer index, got {key!r} ({type(key).__name__})") from None
    if key_type is str and not isinstance(key, str):
        raise ArgumentError(f"{what} must be a module path (str), got {key!r} ({type(key).__name__})")
    return key


def replace_keys(key: Any, key_type: type, all_keys: list, what: str) -> tuple[list, bool]:
    """The keys ``replace(key)`` names, and whether it named one (then it returns one envoy, else a dict).

    ``key``: one key, an iterable of keys, or None for ``all_keys``.

    Raises:
        ArgumentError: a key of the wrong type (``2.0``, ``"2"``, ``True`` for a layer) or an empty iterable.
    """
    if key is None:
        return list(all_keys), False
    if isinstance(key, key_type) and not isinstance(key, bool):
        return [key], True
    if isinstance(key, Mapping):
        raise ArgumentError(f"{what}: got a mapping {key!r}; pass one key or a list of keys")
    if isinstance(key, Iterable) and not isinstance(key, (str, bytes)) and getattr(key, "ndim", 1) != 0:
        keys = [_one_key(k, key_type, what) for k in key]
        if not keys:
            raise ArgumentError(f"{what}: an empty list names nothing to replace (None replaces every one)")
        return keys, False
    return [_one_key(key, key_type, what)], True


def site_placement(model: Any, path: str) -> tuple[torch.device | None, torch.dtype | None]:
    """The device and floating dtype of the module at envoy path ``path`` of ``model`` (nnsight root).

    Read from the module's first parameter, else its nearest ancestor's that has one (a hook point
    has none), else the model's. ``(None, None)`` where the model has no parameters; the device is
    None while the weights are not loaded yet (``meta``: nnsight loads them at the first trace).
    """
    root = hf_module(model)
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        try:
            module = root.get_submodule(".".join(parts[:depth]))
        except AttributeError:
            continue
        param = next((p for p in module.parameters() if p.is_floating_point()), None)
        if param is not None:
            return (None if param.device.type == "meta" else param.device), param.dtype
    return None, None


def check_load_placement(kwargs: Mapping[str, Any]) -> None:
    """A set's ``from_pretrained`` ``device=`` / ``dtype=`` (``kwargs``) checked before anything is read
    (:func:`~.._placement.check_placement_args`), ``device="meta"`` refused: a set computes with its modules at their
    sites, and a module on ``meta`` holds no weights (the set would refuse it once loaded, naming the site).

    Raises:
        ArgumentError: a ``dtype`` other than fp16 / bf16 / fp32 / fp64 or a ``device`` that is not one.
        PlacementError: a ``device`` this machine lacks, or ``meta``."""
    device = check_placement_args(kwargs.get("device"), kwargs.get("dtype"), "from_pretrained")
    if device is not None and device.type == "meta":
        raise PlacementError("from_pretrained(device='meta'): a set's modules compute at their sites and a module on "
                             "meta holds no weights; leave device= out (the files are read to the CPU and each "
                             "module moved to its site's device), or read shapes only with "
                             "formats.load(..., device='meta')")


#: the set that holds each module kind (by class name: the modules are not imported here), for refusals' hints
_SET_OF = {"Lorsa": "LorsaSet", "CrossLayerTranscoder": "CLTSet", "Transcoder": "TranscoderSet",
           "SparseAutoencoder": "SAESet"}


def load_keyed(model: Any, sources: Any, module_type: type, key_of: Callable[[str, Any], Any], *, format: str,
               noun: str, key_name: str, hint: str = "", **kwargs: Any) -> dict:
    """``{key: module}`` from checkpoints (each through ``formats.load_all``), for ``from_pretrained``.

    ``sources``: one checkpoint or set (directory or Hub repo id: :func:`_load_source`), several, or
    ``{key: source}``;
    ``key_of(name, module)``: the key a module's file names (None: the file names none); ``noun``
    names the kind in messages (``"an SAE"``), ``hint`` follows a refusal of another kind. Modules
    are read in ``kwargs["dtype"]``, default ``model``'s dtype (its first floating parameter's), and to
    ``kwargs["device"]`` (the reader's default without it); the set then puts each on its site's device
    whatever ``device`` was (a module computes on its site's device) — or, with ``offload=True`` in
    ``kwargs``, marks them offloaded so that the set keeps them on the host and they never occupy the
    device whole (:attr:`ReplacementSet.offload`).

    Raises:
        ConfigMismatchError: a module not of ``module_type``, a file that names no key (pass
            ``{key: source}``), two modules for one key.
        ArgumentError: ``offload`` not a bool; a ``dtype`` other than fp16 / bf16 / fp32 / fp64 or a ``device``
            that is not one; ``sources`` none of the forms above, or a source in them not a ``str`` /
            ``os.PathLike`` (before anything is read or downloaded).
        PlacementError: a ``device`` this machine lacks, or ``meta`` (:func:`check_load_placement`).
        CheckpointError, UnsupportedArchitectureError: from the readers.
    """
    import os  # local: os is not on NDIF's unpickling whitelist (the sets travel by value)

    from ..formats.files import check_path

    offload = check_flag(kwargs.pop("offload", False), "offload", "from_pretrained")
    check_load_placement(kwargs)
    if kwargs.get("dtype") is None:
        kwargs["dtype"] = site_placement(model, "")[1]
    if not isinstance(sources, (Mapping, str, os.PathLike, list, tuple)):
        raise ArgumentError(f"from_pretrained: sources must be a directory or Hugging Face repo id (a str or "
                            f"os.PathLike), a list of them, or {{{key_name}: source}}; got a {type(sources).__name__}")
    items = sources.items() if isinstance(sources, Mapping) else [
        (None, src) for src in ([sources] if isinstance(sources, (str, os.PathLike)) else sources)]
    if not items:  # an empty list loaded nothing, without a word
        raise ArgumentError(f"from_pretrained: sources is empty ({sources!r}): give at least one checkpoint")
    for _, src in items:
        check_path(src, "from_pretrained")
    found: dict = {}
    names: dict = {}
    for key, src in items:
        for name, module in _load_source(src, format, kwargs).items():
            if not isinstance(module, module_type):  # the set's kind (its ``module_type``)
                held = next((f" (use {kind})" for cls in type(module).__mro__ if (kind := _SET_OF.get(cls.__name__))),
                            hint)  # the set of what it holds (a Lorsa read by TranscoderSet said "use SAESet")
                raise ConfigMismatchError(f"{src}: {name} holds a {type(module).__name__}, not {noun}{held}")
            k = key if key is not None else key_of(name, module)
            if k is None:
                raise ConfigMismatchError(f"{src}: {name} names no {key_name}; pass {{{key_name}: {str(src)!r}}}")
            if k in found:
                raise ConfigMismatchError(f"{src}: {name} is a second {noun.split(maxsplit=1)[-1]} for {key_name} "
                                          f"{k!r} (the first came from {names[k]}); keep one")
            found[k], names[k] = module, name
            if isinstance(module, nn.Module):
                set_offload(module, offload)
    return found


def _load_source(src: Any, format: str, kwargs: dict[str, Any]) -> Any:
    """``formats.load_all`` of one source: a local directory as it is; a Hub repo id (``owner/name``, or
    ``owner/name:subfolder``, that is no local path) first downloaded in the set layout
    (:mod:`~..formats.hub`: every format's checkpoint files at the top and in its folders, with ``revision``,
    ``subfolder`` and ``local_files_only`` from ``kwargs``), then read as a local directory.

    The download fetches the card and the configs first, then the weights those call for (:mod:`~..formats.hub`).
    A downloaded set with a model card (``push_to_hub``'s) or a set index (``set.json``, what ``save`` writes since
    2026-11-28) must hold every folder its card (else its index) lists, each loading; one without either must load
    every folder the snapshot holds checkpoint files of (a folder missing whole is not seen). A local directory with
    a set index must likewise hold every folder it lists, each loading; one without is read as it is.

    Raises:
        CheckpointError: the repo could not be fetched (network, authentication, offline cache miss, no such
            repo or ``subfolder``); a folder the set's card or index lists is missing, holds no checkpoint files or
            does not load (an incomplete download, e.g. an interrupted one that a huggingface_hub without its
            tree-listing cache hands over; a partial copy of a local directory); a folder of a downloaded set
            without a card or index that does not load; a malformed ``set.json``; then as
            :func:`~..formats.registry.load_all`."""
    import warnings  # local, as the others here: what a set shipped by value imports stays small
    from pathlib import Path

    from ..errors import CheckpointError
    from ..formats.files import resolve_checkpoint_dir
    from ..formats.hub import (
        SET_INDEX,
        card_folders,
        looks_like_repo_id,
        set_download_patterns,
        set_index_folders,
        set_weight_patterns,
    )
    from ..formats.reader import hub_configs
    from ..formats.registry import LoadedModules, PartialLoadWarning, load_all, readers_of

    downloaded = looks_like_repo_id(src)
    opts = dict(kwargs)
    hub = {name: opts.pop(name) for name in ("subfolder", "revision", "local_files_only") if name in opts}
    if downloaded:
        readers = readers_of(format)
        # the card and every folder's configs first; then the weights they call for, at the top and one folder down
        local = resolve_checkpoint_dir(src, allow_patterns=set_download_patterns(hub_configs(readers)),
                                       then=lambda d: set_weight_patterns(readers, d), **hub)
        listed = card_folders(local) or set_index_folders(local) or []
    else:
        local = Path(src)
        listed = (set_index_folders(local) if local.is_dir() and not hub else None) or []
        if not listed:  # a directory without a set index (saved before 2026-11-28, another library's): as it is
            return load_all(src, format=format, **kwargs)
    listed = [f for f in listed if f != "."]  # ".": a module at the top (a CLT set's)
    with warnings.catch_warnings():  # a folder that fails is reported below, as the download's
        warnings.simplefilter("ignore", PartialLoadWarning)
        failures: dict[str, Exception]
        try:
            loaded = load_all(local, format=format, **opts)
        except CheckpointError as e:  # none of the folders loaded
            loaded, failures = LoadedModules(), {"(all)": e}
        else:
            failures = dict(loaded.failures)
    if downloaded:
        where = f"{src!r} (revision {hub.get('revision') or 'main'!r}"
        where += f", subfolder {hub['subfolder']!r})" if hub.get("subfolder") else ")"
        what, remedy = "the downloaded snapshot", "an incomplete download (delete that snapshot and download again, " \
            "with network access)"
    else:
        where, what = repr(str(src)), "the directory"
        remedy = "a partial copy of the saved set (copy it again, whole)"
    if not listed and failures:  # no card: a folder whose files are missing or torn is an incomplete download
        if "(all)" in failures:
            raise failures["(all)"]
        torn = {k: e for k, e in failures.items() if isinstance(e, CheckpointError)}
        if torn:
            why = "; ".join(f"{k}: {type(e).__name__}: {e}" for k, e in torn.items())
            raise CheckpointError(
                f"{where}: these folders of the downloaded snapshot {str(local)!r} did not load: {why}: a folder "
                "with a config but not the files it calls for is an incomplete download (delete that snapshot and "
                "download again, with network access); the set has no card listing its folders, so a folder missing "
                "whole cannot be told from a smaller set")
        warnings.warn(PartialLoadWarning(local, failures), stacklevel=3)  # as load_all of the folder warns
    incomplete = [f for f in listed if f not in loaded]
    if incomplete:
        absent = [f for f in incomplete if not (local / f).is_dir()]
        empty = [f for f in incomplete if f not in absent and f not in failures and "(all)" not in failures]
        why = "; ".join(f"{k}: {type(e).__name__}: {e}" for k, e in failures.items())
        lister = "card" if downloaded and card_folders(local) else f"index ({local / SET_INDEX})"
        parts = [*([f"{absent} are missing from {what} {str(local)!r}"] if absent else []),
                 *([f"{empty} hold no checkpoint files"] if empty else []),
                 *([f"these did not load: {why}"] if why else [])]
        raise CheckpointError(f"{where}: the set's {lister} lists the folders {listed}, but " + " and ".join(parts)
                              + f": {remedy}" + ("" if absent or format == "auto" else f", or not format={format!r}"))
    unlisted = {k: e for k, e in failures.items() if k not in listed}
    if listed and unlisted:  # a folder beside the set's (copied in by hand) that does not load: as load_all warns
        warnings.warn(PartialLoadWarning(local, unlisted), stacklevel=3)
    return loaded


class ReplacementSet(Generic[K, M]):
    """Replacement modules of ``model`` keyed by ``K``; see the module docstring.

    Args:
        model: an nnsight ``TransformersModel``/``LanguageModel`` (the root envoy).
        modules: ``{key: module}``, each checked by :meth:`check`.
        adapter: the model family's adapter (default: :func:`get_adapter`).
    """

    #: what one key is (``int`` layers, ``str`` paths): ``replace(key)`` returns one envoy for it.
    key_type: type = object
    #: what the set holds, for messages.
    what: str = "replacement"
    #: the module class the set holds (checked on insertion); the kind registry
    #: (:mod:`.replacement_model`) maps a module to its set through it.
    module_type: type = nn.Module
    #: the :class:`~.replacement_model.ReplacementModel` attribute a set of this kind is held in.
    slot: str = ""
    #: one module replaces every site of a chain at once (a CLT: every MLP), measured per layer by
    #: ``evaluate``; False: each key is one site.
    spans_layers: bool = False

    def __init__(self, model: Any, modules: Mapping[K, M] | None = None,
                 adapter: ArchitectureAdapter | None = None) -> None:
        self.model, self.adapter = model, adapter_for(model, adapter, type(self).__name__)
        self._by_key: dict[K, M] = {}
        self._offload: bool | None = None  # None: each module as it is flagged (a copy of an offloaded one is)
        self.update(modules or {})

    @classmethod
    def holds(cls, module: Any) -> bool:
        """Whether ``module`` is of the kind this set holds (a :attr:`module_type`): every set's one kind check."""
        return isinstance(module, cls.module_type)

    # ------------------------------------------------------------ subclasses
    def wrong_kind(self, key: Any, module: Any) -> str:
        """The message refusing ``module`` (not a :attr:`module_type`) at ``key``.

        Source: ours (the shared contract of this package's replacement sets).
        """
        return (f"{type(self).__name__} holds {self.module_type.__name__} modules; got a {type(module).__name__} "
                f"for {key!r}")

    def check(self, key: Any, module: M) -> K:
        """Validate ``(key, module)`` for this model and return the normalised key.

        Source: ours (the shared contract of this package's replacement sets).
        """
        return key

    def missing(self, key: Any) -> Exception:
        """The error for a key the set has no module for.

        Source: ours (the shared contract of this package's replacement sets).
        """
        return KeyError(f"no {self.what} for {key!r}; this set has {list(self)}")

    def site_path(self, key: K) -> str:
        """Envoy path of the module whose device the replacement at ``key`` runs on (its first site).

        Source: ours (the shared contract of this package's replacement sets).
        """
        raise NotImplementedError

    def site(self, key: K) -> SpliceChain:
        """How the module at ``key`` is spliced: a :class:`~.splice_chain.SpliceChain` (its sites, the step,
        and ``get_output`` / ``set_output``, which read and replace a site's output)."""
        raise NotImplementedError

    # ------------------------------------------------------------ copy / cast
    def subset(self, keys: Iterable[Any] | None = None, transform: Callable[[M], M] | None = None) -> Any:
        """A set of the same kind and model holding the modules at ``keys`` (default: all; keys the set
        lacks are skipped), each passed through ``transform`` (e.g. a copy cast to bf16 for a remote run).
        A per-layer set keeps the layers among ``keys``; an SAE set (keyed by site path) keeps the sites
        among them and, for each layer number among them, the sites inside that layer's block
        (:meth:`~nnsight_lorsa.adapters.base.ArchitectureAdapter.layer_of_path`); with layer numbers, the sites
        outside every layer (the embedding, the final norm) are kept too: no layer names them. (Until 2026-11-29 an
        SAE set kept every site whenever ``keys`` held no site path, so ``for_remote(layers=...)`` shipped all SAEs.)

        Raises:
            ArgumentError: ``keys`` not None or a list / tuple / set of keys (a str is no list of keys: one site
                path was read as its characters), ``transform`` not None or a callable.

        Source: ours (the shared contract of this package's replacement sets).
        """
        if keys is not None and not is_collection(keys):
            raise ArgumentError(f"{type(self).__name__}.subset: keys must be None or a list of keys, got {keys!r}")
        if transform is not None and not callable(transform):
            raise ArgumentError(f"{type(self).__name__}.subset: transform must be None or a callable module -> "
                                f"module, got a {type(transform).__name__}")
        keep = transform if transform is not None else (lambda m: m)
        # an int-like key (a numpy int, a 0-d tensor of a tensor of layers) as the int it is: hashed by identity, a
        # tensor matched no key and the subset came back empty
        wanted = None if keys is None else {int(k) if is_int(k) else k for k in keys}

        layers = set() if wanted is None else {k for k in wanted if isinstance(k, int) and not isinstance(k, bool)}

        def kept(key: Any) -> bool:
            if wanted is None or key in wanted:
                return True
            if self.key_type is not str or not layers:
                return False
            layer = self.layer_of(key)
            return layer is None or layer in layers

        return type(self)(self.model, {k: keep(self[k]) for k in self if kept(k)}, self.adapter)

    def layer_of(self, key: K) -> int | None:
        """The decoder layer the module at ``key`` belongs to: a per-layer set's key itself; an SAE's site inside a
        layer's block that layer (:meth:`~nnsight_lorsa.adapters.base.ArchitectureAdapter.layer_of_path`); None for
        a site outside every layer (the embedding, the final norm) and for a CLT (it spans every MLP).

        Source: ours (the shared contract of this package's replacement sets).
        """
        if isinstance(key, int) and not isinstance(key, bool):
            return key
        return self.adapter.layer_of_path(key) if self.key_type is str and isinstance(key, str) else None

    def n_latents(self, key: K) -> int:
        """How many latents (features, OV heads) the module at ``key`` has: its dead-latent count's size.

        Source: ours (the shared contract of this package's replacement sets).
        """
        module: Any = self[key]
        return int(module.cfg.d_sae)

    def feature_module(self, target: Any) -> Any:
        """The module whose latents a :class:`~.targets.Feature` ``target`` (``target.site``: a key) indexes.

        Raises:
            LayerOutOfRangeError, ConfigMismatchError: no module at ``target.site`` (the set's :meth:`missing`).

        Source: ours (the shared contract of this package's replacement sets).
        """
        return self[target.site]

    def feature_key(self, target: Any) -> Any:
        """The key whose splice computes a :class:`~.targets.Feature` ``target``: ``target.site`` (a CLT set:
        its one key).

        Source: ours (the shared contract of this package's replacement sets).
        """
        return target.site

    def feature_hook(self, envoy: Any, target: Any) -> Any:
        """The envoy whose output holds ``target``'s latents, ``(batch, pos, d_sae)``, given the envoy
        :meth:`replace` returned for :meth:`feature_key`: its ``hook_sae_acts_post`` (a CLT's: layer
        ``target.site``'s).

        Source: ours (the shared contract of this package's replacement sets).
        """
        return envoy.hook_sae_acts_post

    def feature_output_path(self, target: Any) -> str | None:
        """The module whose output the splice computing ``target`` replaces (where its latents are computed: the
        MLP, or Gemma-2/3's post-MLP norm), or None where the set holds no module for it.

        Source: ours (the shared contract of this package's replacement sets).
        """
        key = self.feature_key(target)
        return self.site(key).site_paths[0] if key in self else None

    def by_layer(self) -> dict[int, Any]:
        """``{layer: module}``: what replaces each decoder layer's attention or MLP, one module per layer (the
        attribution graph's view): a per-layer set's own modules; a CLT set one
        :class:`~nnsight_lorsa.modules.clt.CLTLayer` per layer of its CLT.

        Raises:
            ConfigMismatchError: a set keyed by site path (SAEs), which replaces no layer.
        """
        if self.key_type is not int:
            raise ConfigMismatchError(f"{type(self).__name__} is keyed by site path, not by layer")
        return {int(k): self[k] for k in self}  # type: ignore[call-overload]

    def envoys(self, spliced: dict[K, Any]) -> Any:
        """What :meth:`~.replacement_model.ReplacementModel.replace` returns for this set, given the
        envoys ``{key: envoy}`` of its spliced modules: that dict (a CLT set: its one envoy).

        Source: ours (the shared contract of this package's replacement sets).
        """
        return spliced

    def latents_and_output(self, envoy: Any) -> tuple[Any, Any]:
        """``(latents, output)`` envoy values of a spliced module (``replace``'s return): what ``evaluate``
        reads for L0 / dead latents and FVU. Dictionaries: ``hook_sae_acts_post``, ``hook_sae_recons``.

        Source: ours (the shared contract of this package's replacement sets).
        """
        return envoy.hook_sae_acts_post.output, envoy.hook_sae_recons.output

    def label(self, key: K) -> str:
        """How the module at ``key`` is named in reports: ``[2]``, ``['model.layers.3']``.

        Source: ours (the shared contract of this package's replacement sets).
        """
        return f"[{key!r}]"

    # -------------------------------------------------------------------- io
    def folder(self, key: K) -> str:
        """The subfolder :meth:`save` writes the module at ``key`` to: ``layer_<L>`` for a layer, the site
        path itself (``model.layers.3``) for a site."""
        return f"layer_{key}" if self.key_type is int else str(key)

    def key_of_folder(self, name: str) -> Any:
        """The key a :meth:`save` subfolder ``name`` stands for, or None (then the file's own record counts).

        Layers: only ``layer_<ASCII digits>`` names a layer (``layer_02`` is layer 2).

        Raises:
            ConfigMismatchError: a ``layer_…`` name with a digit that is not ``layer_<digits>``
                (``layer_ 2``, ``layer_+2``, ``layer_2_``, ``layer_٢``): refused, not read as a layer
                nor replaced by the file's own record.
        """
        if self.key_type is int:
            # local: formats is not on NDIF's unpickling whitelist (the sets travel by value)
            from ..formats.validate import layer_of_name, looks_like_layer_name

            layer = layer_of_name(name)
            if layer is None and looks_like_layer_name(name):
                raise ConfigMismatchError(f"folder {name!r} is not a layer folder name: only layer_<digits> "
                                          "(ASCII digits, nothing else) names a layer; rename it")
            return layer
        try:
            hf_module(self.model).get_submodule(name)
        except AttributeError:
            return None
        return name

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write each module to ``directory/<folder(key)>/`` (safetensors + JSON, ``formats.save`` in the
        ``"nnsight_lorsa"`` format); the set's ``from_pretrained`` reads the directory back, each module at
        its key, on its site's device (the model's dtype unless given ``dtype=``).

        Atomic as a whole (:func:`~.._atomic.atomic_directory`): the folders are written into a staging directory
        swapped in when all are written, so a failure part-way (``Ctrl-C``, a full disk) leaves the set saved
        there before, whole (until 2026-11-28 each folder was swapped in on its own: a set interrupted part-way
        loaded as a mix of the two sets). Entries of ``directory`` the save does not write (a README, folders of
        keys the set does not hold) are kept. The set index ``set.json`` (:mod:`~..formats.hub`) lists every module
        folder the directory then holds (these keys' and those kept), so that :meth:`from_pretrained` refuses a
        partial copy of it instead of reading a smaller set.

        Raises:
            SaveError: an ``OSError`` while writing (disk full, permission); ``directory`` is left as it was.
            CheckpointError: ``directory`` is a file or the working directory.
            ArgumentError: ``directory`` is not a ``str`` / ``os.PathLike``.
        """
        from pathlib import Path

        from .._atomic import atomic_directory
        from ..formats.files import check_path
        from ..formats.hub import SET_INDEX, set_index
        from ..formats.registry import checkpoint_folders, save

        check_path(directory, f"{type(self).__name__}.save", "a directory")
        with atomic_directory(directory, manifest=None) as stage:  # each folder has its manifest
            written = [self.folder(key) for key in self]
            for key, folder in zip(self, written, strict=True):
                save(self[key], stage.path / folder)
            kept = [p.name for p in checkpoint_folders(Path(directory)) if p.name not in written]  # carried over
            stage.write_json(SET_INDEX, set_index(written + kept), indent=1)

    def push_to_hub(self, repo_id: str, *, metrics: Any = None, subfolder: str | None = None,
                    private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload with nnsight-lorsa") -> str:
        """Publish the set to the Hugging Face Hub model repo ``repo_id`` (created if missing) in the Hub
        layout (:mod:`~..formats.hub`): what :meth:`save` writes (``layer_<L>/config.json`` +
        ``model.safetensors`` + ``checksums.json`` per module) and a model card ``README.md`` (what the set
        holds, ``metrics``, how to load it). The folder is written locally first through the atomic write
        path, then uploaded in one commit (``HfApi.upload_folder``); earlier ``layer_*`` folders of a
        per-layer set at that path that this set does not hold are deleted in the same commit.
        ``from_pretrained(model, repo_id)`` reads it back.

        Args:
            repo_id: ``"owner/name"``.
            metrics: for the card: an :class:`~..training.evaluate.Evaluation` (``evaluate(...)``), a mapping
                of metric names to numbers (e.g. a trainer's ``history[-1]``), or ``{key: either}`` per module.
            subfolder: a folder of the repo to publish into (default: its top), e.g. one per model.
            private: the repo's visibility when it is created (None: the Hub's default). token: a Hub token
                (default: the logged-in one).

        Returns:
            The commit's URL.

        Raises:
            ArgumentError: an empty set; a ``repo_id`` that is not ``owner/name``; a bad ``subfolder``,
                ``private`` or ``commit_message``; ``metrics`` that are not metrics (nothing is uploaded).
            MissingDependencyError: ``huggingface_hub`` is not installed.
            huggingface_hub's errors: authentication, network (from the upload).
        """
        from ..errors import ArgumentError as _ArgumentError
        from ..formats.hub import check_push_args, metrics_table, set_card, stage_and_push

        where = f"{type(self).__name__}.push_to_hub"
        check_push_args(repo_id, subfolder, commit_message, where, private)
        if not len(self):
            raise _ArgumentError(f"{where}: the set is empty; nothing to publish")
        key_name = "layer" if self.key_type is int else "site"
        table = metrics_table(metrics, list(self), key_name, where)  # checked before anything is written
        modules = [(key, self.folder(key), self[key]) for key in self]
        config = getattr(hf_module(self.model), "config", None)

        def write(folder: Any) -> None:
            self.save(folder)
            set_card(folder, kind=type(self).__name__, what=self.what, key_name=key_name, modules=modules,
                     config=config, metrics_table=table, repo_id=repo_id, subfolder=subfolder)

        return stage_and_push(write, repo_id, subfolder=subfolder, private=private, token=token,
                              commit_message=commit_message, where=where,
                              delete_patterns=["layer_*"] if self.key_type is int else None)

    # ------------------------------------------------------------- placement
    def place(self, key: K | None = None) -> None:
        """Move the module at ``key`` (every module when None), in place, to its site's device — or, with
        :attr:`offload`, to the host (pinned where CUDA is available).

        Its dtype is kept (the splice casts inputs and outputs at the boundary; ``module.to(dtype)``
        casts it). A no-op for a site whose weights are not loaded yet (``meta``): the splice then
        places the module when the trace first reaches the site. Called on insertion; call it again
        after moving the model.

        Raises:
            PlacementError: the module is on ``meta`` (never materialised) or cannot be moved.
        """
        for k in [key] if key is not None else list(self):
            self._place_one(k, self._by_key[k])

    def _place_one(self, key: K, module: M) -> None:
        if self._offload is not None:
            set_offload(module, self._offload)
        if offloaded(module):
            store_on_host(module, self.site_path(key))
            return
        device, _ = site_placement(self.model, self.site_path(key))
        if device is not None:
            place(module, device, self.site_path(key))

    @property
    def offload(self) -> bool:
        """Whether the set's modules are *offloaded* (default False): their weights are stored on the host
        (pinned where CUDA is available) and each one is copied to its site's device just before it
        computes there and dropped right after (:class:`~.._placement.resident`) — in ``replace()``'s
        splice (per forward pass and site), in attribution's clean pass and frozen constants; attribution's
        frozen pass copies only the active heads' / features' rows to the device, for each pass
        (docs/attribution.md, "Offloaded replacement modules"). Results are the same as without.
        Setting it moves every module (to the host, or back to its site's device); until it is set, each
        module is as it is marked (a copy of an offloaded module is offloaded), and this reads True when
        every module is. A switch that fails part-way (a CUDA out-of-memory error moving a module to the
        device, ``Ctrl-C``) is undone before the error propagates: the flag, every module's mark and every
        module moved so far are as before the switch.

        Raises:
            ArgumentError: not a bool. PlacementError: as :meth:`place`.
        """
        if self._offload is not None:
            return self._offload
        return bool(self._by_key) and all(offloaded(m) for m in self._by_key.values())

    @offload.setter
    def offload(self, value: Any) -> None:  # checked here: a named error, not a type-checker one
        flag = check_flag(value, "offload", type(self).__name__)
        before, marks = self._offload, {k: offloaded(m) for k, m in self._by_key.items()}
        self._offload = flag
        reached: list[K] = []
        try:
            for k in list(self):
                reached.append(k)
                self._place_one(k, self._by_key[k])
        except BaseException:  # until 2026-11-28 the flag stayed switched with the modules after k not moved
            self._offload = None  # each module back as it was marked, and moved back (freed memory: it fits)
            for k in reached:
                set_offload(self._by_key[k], marks[k])
                self._place_one(k, self._by_key[k])
            self._offload = before
            raise

    def splice_one(self, key: K, module: M, error: bool) -> Any:
        """Splice ``module`` at ``key`` into the current trace along :meth:`site`; return its envoy."""
        return splice_chain(self.model, self.site(key), module, error=error)

    # --------------------------------------------------------------- mapping
    def __setitem__(self, key: K, module: M) -> None:
        if not self.holds(module):
            raise ConfigMismatchError(self.wrong_kind(key, module))
        refuse_training_space(module, f"{type(self).__name__}[{key!r}]")
        k = self.check(key, module)
        check_one_dtype(module, f"the {type(module).__name__} for {self.site_path(k)}")
        with kept_on_failure([module]):  # until 2026-11-28 a failed placement left it marked / partly moved
            self._place_one(k, module)  # before insertion: a module that cannot be placed is not added
        self._by_key[k] = module

    def update(self, modules: Mapping[K, M]) -> None:
        """Add (or replace) several modules, each checked as by ``set[key] = module``.

        Raises:
            ArgumentError: ``modules`` is not a mapping ``{key: module}`` (e.g. a list of modules: which layer
                each replaces is the key).
        """
        items = getattr(modules, "items", None)
        if not callable(items):
            raise ArgumentError(f"{type(self).__name__}: modules must be a mapping {{key: module}} (the key says "
                                f"where each {self.what} goes, e.g. {{layer: module}}), got a {type(modules).__name__}")
        for key, module in items():
            self[key] = module

    def __getitem__(self, key: K) -> M:
        try:
            return self._by_key[key]
        except (KeyError, TypeError):
            raise self.missing(key) from None

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._by_key
        except TypeError:
            return False

    def __iter__(self) -> Iterator[K]:
        return iter(sorted(self._by_key))  # type: ignore[type-var]

    def __len__(self) -> int:
        return len(self._by_key)

    # the read-only mapping protocol by hand: a collections.abc base would make a request that ships a
    # set by value resolve ``abc``, which NDIF's unpickling whitelist does not hold
    def keys(self) -> list[K]:
        return list(self)

    def values(self) -> list[M]:
        return [self._by_key[k] for k in self]

    def items(self) -> list[tuple[K, M]]:
        return [(k, self._by_key[k]) for k in self]

    def get(self, key: Any, default: Any = None) -> Any:
        return self._by_key[key] if key in self else default

    def __repr__(self) -> str:
        body = ", ".join(f"{key!r}: {type(self._by_key[key]).__name__}" for key in self)
        return f"{type(self).__name__}({self.adapter.family}, {{{body}}})"

    # -------------------------------------------------------------- splicing
    def replace(self, key: Any = None, *, error: bool = False) -> Any:  # checked by replace_keys
        """Splice the module(s) at ``key`` (one, several, or all when None) into the current trace.

        Returns the module's envoy for a single key, else a dict ``{key: envoy}``. See the
        subclass for what is replaced and the envoys' children. Inside ``tracer.invoke(...)``: for that invoke's
        rows only (:func:`~.splice_chain.splice_chain`, *Rows*).

        Raises:
            ArgumentError: ``error`` not a bool; a key it does not hold; the set built on a bare torch / Hugging Face
                model, not the nnsight model a trace runs (:func:`~.splice_chain.splice_chain`).

        Source: ours (the shared contract of this package's replacement sets).
        """
        check_flag(error, "error", f"{type(self).__name__}.replace")
        keys, single = replace_keys(key, self.key_type, list(self), f"{type(self).__name__}.replace")
        envoys = {k: self.splice_one(k, self[k], error) for k in keys}
        return envoys[keys[0]] if single else envoys
