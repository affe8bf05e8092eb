"""The tiny models' word-level tokenizer: one id per word, exactly the model's vocabulary,
the special ids of ``hf.tiny_config``, saved beside the checkpoint where transformers'
``AutoTokenizer`` finds it (vLLM loads it the same way: the demos print text with it)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from reshard.errors import ConfigError  # noqa: E402
from reshard.integrations import hf  # noqa: E402
from reshard.tools.rl_task import PROMPTS, SYSTEM_PROMPT, sample_text  # noqa: E402


@pytest.mark.parametrize("vocab_size", [5, 500, 509, 512, 6000])
def test_every_id_below_the_vocabulary_is_one_distinct_word(vocab_size):
    tok = hf.tiny_tokenizer(vocab_size)
    vocab = tok.get_vocab()
    assert len(tok) == vocab_size and sorted(vocab.values()) == list(range(vocab_size))
    words = [tok.convert_ids_to_tokens(i) for i in range(vocab_size)]
    assert all(w and " " not in w for w in words)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.unk_token_id == vocab_size - 1


def test_text_round_trips_and_starts_with_bos():
    tok = hf.tiny_tokenizer(500)
    ids = tok("the trainer sends its weights").input_ids
    assert ids[0] == 1 and len(ids) == 6 and 499 not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "the trainer sends its weights"
    assert tok("the zzz").input_ids == [1, tok.convert_tokens_to_ids("the"), 499]


def test_build_tiny_model_saves_it_where_autotokenizer_loads_it(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = hf.build_tiny_model(tmp_path / "m", "qwen3", vocab_size=500)
    assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(path))
    config = AutoConfig.from_pretrained(str(path))
    assert len(tok) == config.vocab_size == 500
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        config.pad_token_id, config.bos_token_id, config.eos_token_id)
    # the demo's token-id prompts decode to words (no unknown token among them)
    for prompt in PROMPTS:
        words = tok.decode(prompt[len(SYSTEM_PROMPT):]).split()
        assert len(words) == len(prompt) - len(SYSTEM_PROMPT) and "<unk>" not in words
    assert sample_text(tok, (PROMPTS[2], [3, 4])) == (
        f'"{tok.decode(PROMPTS[2][len(SYSTEM_PROMPT):])}" -> "the trainer"')


def test_a_checkpoint_of_the_model_keeps_its_tokenizer(tmp_path):
    path = hf.build_tiny_model(tmp_path / "m", "qwen3", vocab_size=500)
    state = hf.load_model(path).state_dict()
    out = hf.save_checkpoint(path, state, tmp_path / "step1")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (path / name).read_bytes()


def test_a_vocabulary_too_small_for_the_special_tokens_is_refused():
    with pytest.raises(ConfigError, match="vocab_size must exceed 4"):
        hf.tiny_tokenizer(4)
