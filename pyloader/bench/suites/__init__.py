"""The benchmark suites, one module each; ``bench/<name>.py`` are their command lines.

Each suite's ``main(argv)`` runs it and writes its raw result under
:data:`pyloader.bench.results.RAW`; its table functions render a raw result, which
:mod:`pyloader.bench.results` keeps as a summary and puts on the results page.
``llamacpp_engine`` runs in another Python (the one with llama-cpp-python) and imports
nothing of pyloader.
"""
