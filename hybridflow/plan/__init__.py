"""The layout planner: the fastest training and generation views and memory levers that fit the GPUs.

``search`` scores every layout the engine accepts for a model and a world (``plan_layout``, ``Layout``);
``memory`` estimates each phase's bytes per GPU and reads this machine's memory; ``step_time`` estimates a
step's seconds; ``report`` writes the figures and the candidates table; ``shapes`` holds the model shapes
``hybridflow plan --model-shape`` knows; ``auto_layout`` applies the plan to a run's config, as
``hybridflow train`` and the Python APIs do. The planner sits below the trainer (it reads a config and
the engine's accounting, and starts nothing), so the CLI, the trainer's out-of-memory message and the
benchmarks all use it.
"""
