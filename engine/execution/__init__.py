"""Running the model on a step's batch.

    runner.py        flattens a batch's new tokens, sets the forward context, runs the model, samples
    cuda_graphs.py   decode steps captured per batch-size bucket
    launch_ahead.py  the next decode batch launched before the step that feeds it ends
    memory_plan.py   the KV memory's size at start, measured after a warm-up
    engine_stats.py  EngineStats read from the engine's parts
"""
