"""Settings passed from Python (audit): a misspelled key suggests the API's own name (`cach` -> `cache`), and a
value of the wrong type is a one-line ConfigError naming the setting, never a bare TypeError; strings that read as
the setting's type are accepted, as the CLI and the environment give them."""

from __future__ import annotations

from pathlib import Path

import pytest

import sinkchat
from sinkchat.api import settings_for
from sinkchat.bootstrap import build_settings
from sinkchat.config import ConfigError


def test_misspelled_key_suggests_the_api_name():
    with pytest.raises(ConfigError, match=r"unknown setting 'cach' \(did you mean 'cache'\?\)") as e:
        sinkchat.load(cach=512)
    listed = str(e.value).split("settings: ")[1].split(", ")
    assert "cache" in listed and "cache_size" not in listed and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"did you mean 'cache_size'"):  # the CLI's own keys keep theirs
        build_settings({"cache_sze": 512})


@pytest.mark.parametrize("kw, named", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": [0.5]}, "top_p must be a number"),
    ({"repetition_penalty": None, "temperature": True}, "temperature must be a number"),
    ({"cache": "big"}, "cache must be a whole number"),
    ({"cache": 512.5}, "cache must be a whole number"),
    ({"sinks": "4.5"}, "sinks must be a whole number"),
    ({"max_tokens": True}, "max_tokens must be a whole number"),
    ({"memory_bits": "eight"}, "memory_bits must be a whole number"),
    ({"seed": 1.5}, "seed must be a whole number"),
    ({"quant": 4}, "quant must be a string"),
    ({"policy": ["sink"]}, "policy must be a string"),
    ({"memory": True}, "memory must be a string"),
    ({"top_k": {}}, "top_k must be a whole number"),
    ({"gauge_every": "often"}, "gauge_every must be a whole number"),
])
def test_wrong_type_is_a_config_error_naming_the_key(kw, named):
    with pytest.raises(ConfigError, match=named) as e:
        sinkchat.load(**kw)
    assert "\n" not in str(e.value)


def test_strings_that_read_as_the_type_are_accepted():
    s = settings_for(Path("m.gguf"), "512", temperature="0.5", sinks=" 2 ", seed="-3", memory_bits="8", top_p=1,
                     max_tokens=64.0)
    assert (s.model.model, s.cache.capacity, s.cache.n_sink, s.sampling.temperature) == ("m.gguf", 512, 2, 0.5)
    assert (s.sampling.seed, s.memory.bits, s.sampling.top_p, s.sampling.max_tokens) == (-3, 8, 1.0, 64)
    with pytest.raises(ConfigError, match="temperature must be between 0 and 10"):  # the range, as before
        settings_for(temperature="11")
