"""The CPU demo, apart from the library: `swe-grpo demo` (`run.py`), the warm-started tiny policy it
trains (`warm_start/`) and the three bundled tasks it trains on (`tasks/`, also what
`swe_grpo.demo.tasks.demo_tasks()` loads). The library's data path never imports this package.
"""

from swe_grpo.demo.run import DemoConfig, DemoResult, plot_results, run_demo, run_in_terminal, save_curve, save_result

__all__ = ["DemoConfig", "DemoResult", "plot_results", "run_demo", "run_in_terminal", "save_curve", "save_result"]
