"""The served model: mlx-lm's ``ModelProvider`` over :func:`pyloader.load_model`."""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import threading

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.processors import load_processor
from mlx_lm.server import ModelProvider

from ..kv import make_kv_cache
from ..loading import load_model
from ..streaming.options import StreamOptions
from .requests import Limits, context_of, vocab_size_of
from .settings import ServeOptions

log = logging.getLogger(__name__)


class GenerationFatal(BaseException):
    """Stops the generation thread for good (mlx-lm's loop catches ``Exception`` only)."""


def checkpoint_changed(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is a checkpoint file changing on disk (``ESTALE``)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ESTALE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class PyloaderModelProvider(ModelProvider):
    """mlx-lm's model provider, loading through :func:`pyloader.load_model` on mlx-lm's
    generation thread (the draft model fully resident).

    Attributes:
        options: The :class:`ServeOptions` every load uses.
        loaded, load_error: Set when the first load has finished; its exception, if any.
        thread_id: OS thread id of the loading thread, once it has loaded.
        vocab_size, context: The loaded model's logits width and context (None: unknown).
    """

    def __init__(self, cli_args: argparse.Namespace, options: ServeOptions):
        super().__init__(cli_args)
        self.options = options
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.thread_id: int | None = None
        self.vocab_size: int | None = None
        self.context: int | None = None
        self.reopening = False

    def reopen(self) -> None:
        """Reload the model on the next request (a file changed on disk)."""
        self.model_key = None
        self.reopening = True

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        self.thread_id = threading.get_native_id()
        try:
            self._load_with_pyloader(model_path, adapter_path, draft_model_path)
        except BaseException as exc:
            if not self.loaded.is_set():
                self.load_error = exc
            if self.reopening:
                raise GenerationFatal(f"reopening {model_path} after its files changed "
                                       f"on disk failed: {type(exc).__name__}: {exc}") from exc
            raise
        finally:
            self.loaded.set()
        if self.reopening:
            log.warning("reopened %s: its files changed on disk", model_path)
            self.reopening = False

    def _load_with_pyloader(self, model_path, adapter_path, draft_model_path) -> None:
        if self.is_distributed:
            raise ValueError("pyloader serve runs in one process; for distributed serving "
                             "use mlx_lm.server")
        # Drop the previous model first and clear MLX's pool: two models never coexist.
        self.reset()
        self.vocab_size = self.context = None  # a failed load leaves no stale limits
        gc.collect()
        mx.clear_cache()

        # the options plus mlx-lm's adapter and tokenizer settings
        model, tokenizer, config = load_model(
            model_path, **self.options.load_kwargs(), adapter_path=adapter_path,
            tokenizer_config=self._tokenizer_config,
            trust_remote_code=self.cli_args.trust_remote_code, return_config=True)
        if tokenizer is None:
            raise FileNotFoundError(
                f"{model_path} has no tokenizer (tokenizer.json / tokenizer_config.json): "
                "serving needs one; copy the tokenizer files of the original model into it")
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template

        vocab_size = vocab_size_of(model, config)
        draft_model = None
        if draft_model_path is not None:
            whole = StreamOptions(strategy=self.options.stream.strategy)
            draft_model, draft_tokenizer = load_model(draft_model_path, options=whole,
                                                      kernels=self.options.kernels)[:2]
            if draft_tokenizer is not None and draft_tokenizer.vocab_size != tokenizer.vocab_size:
                log.warning("the draft model's tokenizer does not match the model's: "
                            "speculative decoding may not work as expected")
            # the request's logits processors run on the draft model's logits too
            draft_vocab = vocab_size_of(draft_model, {})
            vocab_size = (None if vocab_size is None or draft_vocab is None
                          else min(vocab_size, draft_vocab))

        if self.options.kv_context is not None:
            # One cache, dropped at once: an impossible cache fails the load, not a request.
            make_kv_cache(model, max_context=self.options.kv_context)
        # Batching would copy a preallocated cache out of its arena: serve one at a time.
        batchable = (draft_model is None and self.options.kv_context is None
                     and all(hasattr(c, "merge") for c in make_prompt_cache(model)))

        self.vocab_size = vocab_size
        self.context = context_of(config)
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model = model
        self.tokenizer = tokenizer
        self.processor = load_processor(model, config)
        self.draft_model = draft_model
        self.is_batchable = batchable
        log.info("loaded %s with pyloader (%s)%s", model_path, self.options,
                 "" if batchable else "; requests are served one at a time")

    def limits(self) -> Limits:
        """The loaded model's numbers a request is checked against."""
        return Limits(vocab_size=self.vocab_size, context=self.context)


class PreallocatedPromptCache(LRUPromptCache):
    """mlx-lm's prompt cache store; a miss gets a preallocated KV cache."""

    def __init__(self, provider: ModelProvider, max_context: int, max_size: int = 10,
                 max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self.provider = provider
        self.max_context = max_context

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is None:
            cache = make_kv_cache(self.provider.model, max_context=self.max_context)
            if self.provider.draft_model is not None:
                cache += make_prompt_cache(self.provider.draft_model)
        return cache, rest


