"""The nnsight glue: replacement modules spliced into a trace, their internals as envoys (needs nnsight).

* :class:`ReplacementModel` — a model and its replacements in one object, the argument that
  attribution, patching, analysis and dashboards take; ``replace()`` splices all of them.
* The sets, one per kind, each with ``replace(...)`` inside a trace and ``from_pretrained`` /
  ``save``: :class:`LorsaSet` (attention), :class:`TranscoderSet` (MLPs), :class:`CLTSet`
  (all MLPs, one cross-layer transcoder), :class:`SAESet` (any module's output).
* Targets of interventions: :class:`MHSAHead`, :class:`LorsaHead`, :class:`Feature`; a place in the
  model whose activations are read: :class:`Site` (:mod:`.read`).

Loading a local Hugging Face directory (default: the embedded model) offline: :func:`load_model`
(:mod:`.loading`). Models without a tokenizer: :func:`load_tokenizer` (:mod:`.tokens`) gives ``TransformersModel`` a
stand-in that takes token ids everywhere and refuses text with ``MissingTokenizerError``.

Mechanism: :mod:`.splice_chain` (one replacement over one or several sites, error terms), every
use of nnsight's private internals in :mod:`.nnsight_internals`. See docs/nnsight.md.
"""

from .clt_set import CLTSet
from .loading import load_model
from .lorsa_set import LorsaSet
from .read import Site
from .replacement_model import ReplacementModel
from .sae_set import SAESet
from .targets import Feature, LorsaHead, MHSAHead
from .tokens import load_tokenizer
from .transcoder_set import TranscoderSet

__all__ = ["CLTSet", "Feature", "LorsaHead", "LorsaSet", "MHSAHead", "ReplacementModel", "SAESet", "Site",
           "TranscoderSet", "load_model", "load_tokenizer"]
