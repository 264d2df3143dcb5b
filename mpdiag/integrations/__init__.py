"""Callbacks for the trainers users already have, each thin over mpdiag's own instrumentation: Lightning's
(:mod:`mpdiag.integrations.lightning`, over the Recorder) and Hugging Face's (:mod:`mpdiag.integrations.huggingface`,
over watch's session). Each records the run ``mpdiag watch`` would record of the same script, and stands aside when
the script already runs under ``mpdiag watch``. Their frameworks are imported only by the module that needs one."""
