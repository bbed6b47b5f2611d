"""Train Lorsas, SAEs, (skip) transcoders and cross-layer transcoders on a model's activations.

One front door for every module kind::

    data = TokenDataset.from_text(model.tokenizer, text, seq_len=128)
    train, heldout = data.split(0.1)
    source = ActivationSource.transcoder(model, 1, train, batch_size=16)    # or .attention / .sae / .clt
    trainer = Trainer(module, source, TrainConfig(total_steps=1000))
    trainer.train()
    ev = evaluate(TranscoderSet(model, {1: trainer.folded()}), heldout)    # -> Evaluation

* :class:`TokenDataset` — a corpus cut into ``[BOS] + …`` windows.
* :class:`ActivationSource` — batch index -> :class:`~.activations.Batch` of the activations the
  module reads (``x``) and reconstructs (``y``), from named :class:`~..envoy.read.Site` s, live
  through nnsight or from an on-disk activation cache (:mod:`.activation_cache`).
* :class:`Trainer` + :class:`TrainConfig` (on :class:`OptimConfig`, the settings every trainer shares) — one
  loop for every module (objectives in :mod:`.objectives`), exact checkpoint resume, data parallelism
  (:mod:`.distributed`); a Lorsa's MHSA initialisation and :class:`LorsaRecipe` go in its :class:`LorsaObjective`.
* :func:`evaluate` -> :class:`Evaluation` — FVU, L0, dead fraction, CE orig / spliced / zero-ablated,
  CE recovered and KL with the module spliced in; the same metric names for every module kind.
"""

from .activation_cache import ActivationCache, write_activation_cache
from .activations import ActivationSource
from .dataset import TokenDataset
from .distributed import DataParallel
from .evaluate import Evaluation, evaluate
from .lorsa_recipe import LorsaRecipe
from .objectives import LorsaObjective
from .train_config import OptimConfig
from .trainer import TrainConfig, Trainer

__all__ = ["ActivationCache", "ActivationSource", "DataParallel", "Evaluation", "LorsaObjective", "LorsaRecipe",
           "OptimConfig", "TokenDataset", "TrainConfig", "Trainer", "evaluate", "write_activation_cache"]
