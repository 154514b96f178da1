"""Write tests/fixtures/meta_tokenizer_ids.json: Meta's token ids for a few hundred prompts a user may type.

The reference is open_clip's `SimpleTokenizer` (ftfy, HTML unescaping, whitespace cleaning, lower case, special
tokens `<start_of_text>`/`<end_of_text>`), which Meta's `sam3/model/tokenizer_ve.py` copies, at SAM3's context of 32.
Its module is loaded from the open-clip-torch wheel's file, not imported as a package (open_clip's package needs
torchvision, which this project keeps out). open-clip-torch is no dependency of the project any more (the vocabulary
ships with sam3_aoti); rerun after changing the prompts below with it added for this one run:
    uv run --with open-clip-torch==3.3.0 python scripts/make_tokenizer_fixture.py
"""

import importlib.util
import json
from importlib import metadata
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "meta_tokenizer_ids.json"

PLAIN = ["a red car", "solar panels", "swimming pool", "a person", "shipping containers", "wind turbine",
         "a cup of coffee", "roof", "the rocket", "parked airplanes", "tennis court", "greenhouse",
         "a dog on a leash", "road markings", "construction crane", "oil storage tank", "a boat", "cattle",
         "railway tracks", "a yellow school bus"]
TRICKY = [
    # curly quotes, primes, dashes
    "children’s bike", "children's bike", "“smart” phone", "‘single’ quotes", "the dog’s ball", "o’clock",
    "it′s a prime", "6″ pipe", "a – dash", "a — em dash", "don’t", "rock ‘n’ roll", "‛reversed‛", "„low“",
    # ligatures
    "ﬁre hydrant", "ﬂag pole", "oﬃce building", "staﬀ room", "ﬀ ﬁ ﬂ ﬃ ﬄ ﬅ ﬆ", "Ꜳ ligature", "æsthetic",
    # full-width and compatibility forms
    "ｃａｒ", "ＲＥＤ ＣＡＲ", "ｔｒｕｃｋ １２３", "ｈｏｕｓｅ！", "①②③", "㎞ road", "™ logo", "№ 5",
    # decomposed and precomposed accents
    "cafe\u0301", "café", "nin\u0303o", "niño", "résumé", "Ångström", "A\u030angstro\u0308m", "crème brûlée",
    "naïve", "Zoë", "São Paulo", "Ærø", "Łódź", "Škoda",
    # mojibake
    "cafÃ©", "Ã©tÃ©", "donâ€™t", "â€œsmartâ€\x9d phone", "SÃ£o Paulo", "naÃ¯ve", "Ã¼ber", "Ã…ngstrÃ¶m",
    "â€˜quotedâ€™", "piÃ±a colada",
    # control and invisible characters
    "a\x00car", "tab\tseparated", "line\nbreak", "carriage\r\nreturn", "\x1b[31mred\x1b[0m car", "zero\u200bwidth",
    "\ufeffbom car", "soft\u00adhyphen", "a\x07bell", "del\x7fete", "nbsp\u00a0car", "em\u2003space",
    "ideographic\u3000space", "sep\x1cfile", "sep\x1dgroup", "sep\x85next", "line\u2028sep", "para\u2029sep",
    "  leading and trailing  ", "many     spaces", "\t\ttabs\t", "a\u200dzwj", "rtl\u200fmark", "\u2060word joiner",
    # HTML
    "&amp;", "cats &amp; dogs", "&lt;b&gt;bold&lt;/b&gt;", "&amp;amp; twice", "it&#39;s", "&quot;quoted&quot;",
    "&nbsp;space", "&eacute;t&eacute;", "&#x41;&#66;C", "&copy; 2024", "<b>tag</b> car", "a &lt; b",
    "&amp;lt;double&amp;gt;", "R&D building", "&unknown; entity",
    # special tokens, either spelling, any case
    "<start_of_text>", "<end_of_text>", "a <start_of_text> cat", "<START_OF_TEXT> dog", "<|startoftext|> a cat",
    "<|endoftext|>", "<start_of_text><end_of_text>", "end_of_text", "<pad>", "<unk> thing",
    # numerals and digits
    "½ pipe", "2nd floor", "٣ cats", "Ⅻ", "x²", "10,000 m²", "3.14159", "007", "1/2 inch", "1st place",
    "٠١٢٣", "१२३", "²³¹", "⅓ cup", "12:30 pm", "2024-01-01", "#42", "1e10", "−5 °C", "$100",
    # scripts and emoji
    "自行车", "自転車に乗る人", "자전거", "велосипед", "ποδήλατο", "دراجة", "אופניים", "साइकिल", "จักรยาน",
    "🚲 bike", "👍🏽 thumbs", "🇩🇪 flag", "👨‍👩‍👧 family", "❤️ heart", "☕ coffee", "🏠🏠🏠", "a 🐕 dog",
    # case
    "A RED CAR", "Solar Panels", "İstanbul", "STRASSE", "straße", "ΣΑΣ", "ǅemal", "ﬀ LIGATURE CAPS",
    "McDonald's", "iPhone", "I'M HERE",
    # contractions and punctuation
    "it's", "IT'S", "they've", "we'll", "you're", "i'm", "he'd", "can't", "cars'", "'s", "'quoted'",
    "car!!!", "...", "a-b_c", "#hashtag", "@user", "e-mail", "U.S.A.", "snake_case_word", "(parenthesis)",
    "[brackets]", "{braces}", "semi;colon", "a/b/c", "back\\slash", "~tilde~", "100%", "a+b=c", "<>", "|pipe|",
    "a,b,c", "?!", "\"double\"", "`backtick`", "*star*", "^caret", "a&b", "under_score_", "__dunder__",
    # long prompts: truncated to 30 words between start and end
    " ".join(["building"] * 40),
    "a very long description of a small red car parked next to a large white truck on a busy street in the "
    "middle of a sunny afternoon with many people walking",
    " ".join(f"word{i}" for i in range(35)),
    "supercalifragilisticexpialidocious " * 3,
    "pneumonoultramicroscopicsilicovolcanoconiosis",
]
PROMPTS = PLAIN + [f"{p}’s shadow" for p in PLAIN[:10]] + [p.upper() for p in PLAIN[10:]] + TRICKY


def meta_tokenizer():
    path = next(f for f in metadata.files("open-clip-torch") if f.name == "tokenizer.py" and "open_clip" in str(f))
    spec = importlib.util.spec_from_file_location("open_clip_tokenizer", path.locate())
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SimpleTokenizer(context_length=32)


def main() -> None:
    tokenizer = meta_tokenizer()
    rows = tokenizer(PROMPTS).tolist()
    cases = [{"prompt": p, "ids": row} for p, row in zip(PROMPTS, rows)]  # 32 ids each, zero padded
    versions = {name: metadata.version(name) for name in ("open-clip-torch", "ftfy", "regex")}
    header = {"reference": "open_clip.tokenizer.SimpleTokenizer(context_length=32), the tokenizer Meta's "
                           "sam3/model/tokenizer_ve.py copies", "versions": versions}
    lines = ",\n".join(json.dumps(case, ensure_ascii=True) for case in cases)  # one prompt per line
    OUT.write_text(json.dumps(header)[:-1] + ', "cases": [\n' + lines + "\n]}\n")
    print(f"{len(cases)} prompts -> {OUT}")


if __name__ == "__main__":
    main()
