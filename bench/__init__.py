"""The benchmark harness: our engine against transformers' baselines and vLLM's CPU backend, and the
kernel benchmarks.

Everything that measures lives here, outside the serving path: ``bench`` may import any part of the
project (``engine``, ``kernels``), and nothing in the project imports ``bench`` (``tests/test_layout.py``
checks it).

Modules, by job:

* :mod:`bench.cli` (``python -m bench``): the command line, the orchestration of runs, ``--json`` /
  ``--html`` output;
* :mod:`bench.workloads`: requests, the W64 file, offline / online (Poisson) / multi-turn workloads;
* :mod:`bench.systems`: the systems compared (ours continuous and static, transformers' static
  ``generate`` and its continuous batching) and the model-free schedule replay;
* :mod:`bench.metrics`: forward timing, step and request records, summaries, tables, the machine;
* :mod:`bench.step_profile`: where one decode step spends its time;
* :mod:`bench.report` (``python -m bench.report results.json report.html``): the Plotly HTML report;
* :mod:`bench.kernels` (``python -m bench.kernels``): the paged-attention kernels on a GPU;
* :mod:`bench.compile_report` (``python -m bench.compile_report``): the Triton kernels compiled for
  sm_90 without a GPU, with their registers, spills and shared memory;
* :mod:`bench.peers` (``make bench-peers``): ours against vLLM's CPU backend in one run (W64, a long
  prefill, the mixed case, HTTP); :mod:`bench.peers_run` runs vLLM's side and the servers as
  subprocesses; ``bench/vllm_worker.py`` and ``bench/vllm_serve_client.py`` run inside vLLM's own venv
  (``bench/peers_setup.sh``); :mod:`bench.hf_export` writes the embedded model as a Hugging Face folder;
* :mod:`bench.latency` (``python -m bench.latency``): running chats' token gaps while a long prompt is
  prefilled, and that prompt's time to first token against its prefill alone;
* :mod:`bench.memory_burst` (``python -m bench.memory_burst``): the server's RSS before, during and after
  a burst of bad bodies and good requests, the server in its own process on 127.0.0.1.

The reference workload W64 is ``bench/w64.json``.
"""
