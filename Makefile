.PHONY: run test bench fuzz docs gpu-check gpu-session clean
VENV := .venv/.k3sched-setup

$(VENV): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

run: $(VENV)
	.venv/bin/k3sched plan configs/tiny-cpu.yaml --out out/tiny-cpu/plan --timeline
	.venv/bin/k3sched run configs/tiny-cpu.yaml --out out/tiny-cpu --steps 5 --trace-steps
	.venv/bin/k3sched validate --plan out/tiny-cpu/plan.json out/tiny-cpu/trace_rank*.json --cross-rank-clocks --json out/tiny-cpu/validation.json
	.venv/bin/k3sched calibrate out/tiny-cpu/trace_steps_rank*.json --plan out/tiny-cpu/plan.json -o out/tiny-cpu/profile.yaml
	.venv/bin/k3sched plan configs/tiny-cpu.yaml --set schedule.profile=out/tiny-cpu/profile.yaml --out out/tiny-cpu/calibrated

test: $(VENV)
	.venv/bin/python -m pytest -q

bench: $(VENV)
	for b in benchmarks/bench_*.py; do .venv/bin/python $$b || exit 1; done

fuzz: $(VENV)
	.venv/bin/python benchmarks/fuzz_campaign.py

# docs/cli.md and docs/config.md, generated from the CLI and the config models (k3sched/docgen.py).
docs: $(VENV)
	.venv/bin/python -m k3sched.docgen

# GPU smoke check (scripts/gpu_smoke.py): serial vs k3 in one process on cuda:0 with lane streams,
# with random delays injected per lane; DEVICE=cpu runs the same matrix on CPU threads.
DEVICE ?= cuda
gpu-check: $(VENV)
	timeout 300 .venv/bin/python scripts/gpu_smoke.py --device $(DEVICE)

# The checks of one short GPU session (scripts/gpu_session.sh; DEVICE=cpu: a dry run on CPU threads).
gpu-session: $(VENV)
	PY=.venv/bin/python DEVICE=$(DEVICE) bash scripts/gpu_session.sh

clean:
	rm -rf out .pytest_cache
