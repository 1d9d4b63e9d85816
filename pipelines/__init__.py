"""pipelines: the job machinery of mtplx-batch: job (config), io (sources, sinks), execution (session, executors), cli."""
