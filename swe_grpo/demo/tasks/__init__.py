"""Small demo tasks shipped with swe_grpo: `tasks.jsonl` and one git bundle per repository in `repos/`,
built by `build.py` from the plain source trees in `src/`. Load them with `swe_grpo.tasks.demo_tasks()`."""
