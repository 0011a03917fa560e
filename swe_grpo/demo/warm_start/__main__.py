"""`python -m swe_grpo.demo.warm_start build|ship|capture` (see `swe_grpo.demo.warm_start.policy.main`)."""

from swe_grpo.demo.warm_start.policy import main

raise SystemExit(main())
