"""The one option grammar: NAME@WORD+WORD, each word one constructor flag the backend declares."""
import pytest

from msa_bench.kernels.options import Choice, Number, Rest, describe_options, parse_options


def _order(word: str) -> str:
    if not word[:1].isdigit():
        raise ValueError(f"order {word!r} is not a number")
    return word


OPTIONS = {"kernel": Choice("kernel", ("v23", "v28"), refuses=r"v\d+"),
           "tile": Number("tile size", "p", (8, 16)),
           "flag": Choice("flag", {"on": True, "plain": False}),
           "other": Choice("other flag", {"yes": True, "plain": False}),
           "order": Rest("order", _order, "N", ("2", "4"))}


def test_words_set_their_flags_in_any_order_with_any_joiner():
    want = {"kernel": "v28", "tile": 16, "order": "2"}
    assert parse_options("b", OPTIONS, "v28+p16+2") == want
    assert parse_options("b", OPTIONS, "2@p16-v28") == want
    assert parse_options("b", OPTIONS, "plain") == {"flag": False, "other": False}      # a word of two flags


@pytest.mark.parametrize("text, problem", [
    ("v99", "b has no kernel 'v99'"),                 # taken by the kernel option only to be refused
    ("p12", "b has no tile size 'p12'"),
    ("x", "b: order 'x' is not a number"),            # a word no option takes: the rest option's
    ("p8+p16", "b@p8+p16 sets its tile size twice"),
    ("on+plain", "b@on+plain sets its flag twice"),
    ("v23+", "b@v23+ has an empty option"),
])
def test_a_bad_option_is_one_line_naming_the_options(text, problem):
    with pytest.raises(ValueError) as exc:
        parse_options("b", OPTIONS, text)
    message = str(exc.value)
    assert message == f"{problem}; {describe_options('b', OPTIONS)}" and "\n" not in message


def test_the_message_lists_each_option_once():
    assert describe_options("b", OPTIONS) == ("b options are v23|v28 (kernel), p8|p16 (tile size), on|plain (flag), "
                                              "yes|plain (other flag), N (order), joined by '+'")
    assert Number("share", "m", tuple(range(1, 17))).spelling() == "m1..m16"


def test_without_a_rest_option_an_unknown_word_is_refused():
    with pytest.raises(ValueError, match="b has no option 'x'"):
        parse_options("b", {"tile": Number("tile size", "p", (8,))}, "x")
    with pytest.raises(ValueError, match="backend 'b' takes no @option"):
        parse_options("b", {}, "p8")
