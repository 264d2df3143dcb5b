"""Recording: the Recorder (the one instrumentation point a training loop calls), its background writer
thread and module tracing hooks. Writes through the store; never reads pages or analysis."""
