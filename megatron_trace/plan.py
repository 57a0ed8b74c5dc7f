"""``python -m megatron_trace.plan``: the guidance-cache planner (implementation in ``cli/plan.py``)."""

from .cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
