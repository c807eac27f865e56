"""pd-router: a prefill/decode disaggregation router for vLLM."""

__version__ = "0.1.0"
