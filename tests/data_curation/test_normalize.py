import sys
import unicodedata

from data_curation.normalize import INVISIBLE_RANGES, NormalizeConfig, Normalizer


def test_invisible_table_matches_unicode_database():
    covered = set()
    for a, b in INVISIBLE_RANGES:
        for cp in range(a, b + 1):
            covered.add(cp)
            assert unicodedata.category(chr(cp)) in ("Cf", "Co", "Cs", "Cn"), hex(cp)
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp)) in ("Cf", "Co", "Cs"):
            assert cp in covered, hex(cp)


def test_unicode_traps_normalise_to_plain_tokens():
    n = Normalizer()
    assert n.tokens("pass\u200dword") == ["password"]            # ZWJ inside a word
    assert n.tokens("in\u200bvis\u2060ible\ufeff") == ["invisible"]
    assert n.tokens("\uff11\uff12\uff13 apples") == ["123", "apples"]  # full-width digits
    assert n.tokens("a\u00a0b") == ["a", "b"]                    # NBSP
    assert n.text("\u202eevil\u202c text") == "evil text"        # RTL override
    assert n.text("Hello,   WORLD!!") == n.text("hello world")
    assert n.text("\ufb01ne") == "fine"                          # ligature


def test_latex_spacing_folds():
    n = Normalizer()
    a = n.text(r"Find $\frac{m}{n}$ where $\left( x \right)$ and \, $m+n$")
    b = n.text(r"find $ \dfrac {m} {n} $ where $ ( x ) $ and  $m + n$")
    assert a == b


def test_digit_and_punctuation_policies():
    assert Normalizer(NormalizeConfig(digits="zero")).text("x = 42") == "x 00"
    assert Normalizer(NormalizeConfig(digits="remove")).text("x = 42") == "x"
    assert Normalizer(NormalizeConfig(punctuation="fold")).tokens("\u201cok\u201d \u2014 yes") == \
        ['"', "ok", '"', "-", "yes"]
    assert Normalizer(NormalizeConfig(casefold=False)).text("ABC") == "ABC"
