"""nnsight integration: splicing replacement modules into a trace (needs nnsight)."""
