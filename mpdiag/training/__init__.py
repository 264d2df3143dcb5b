"""Training: model scripts and their contract, one precision policy per opt level, and the training loop
that drives a script through a policy into the Recorder (runs, FP32 pairs, reruns)."""
