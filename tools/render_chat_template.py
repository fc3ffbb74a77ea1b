#!/usr/bin/env python3
"""Render a chat template the way Hugging Face `transformers` does (Jinja2 sandbox,
`trim_blocks`/`lstrip_blocks`, `loopcontrols`, `raise_exception`, `strftime_now`, and `tojson` as
`json.dumps(ensure_ascii=False)`), to produce the expected strings of
crates/tessera-model/tests/chat.rs. Only jinja2 is needed (not transformers).

    python3 tools/render_chat_template.py TEMPLATE.jinja BOS EOS [--date YYYY-MM-DD] [--transformers]

prints, as JSON, the rendering of each conversation of CONVERSATIONS with and without the
generation prompt. `--date` fixes `strftime_now` (the test masks the date it renders).
`--transformers` renders with `transformers`' own `render_jinja_template` instead (needs it
installed; `--date` does not apply there), to check that this script agrees with it.
"""
import datetime
import json
import sys

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONVERSATIONS = {
    "sys_user": [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "Hello! Who are you?"}],
    "multi": [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "Bye"}],
    "user_only": [{"role": "user", "content": "  padded  "}],
}


def main():
    args = sys.argv[1:]
    date = None
    if "--date" in args:
        i = args.index("--date")
        date = datetime.datetime.strptime(args[i + 1], "%Y-%m-%d")
        args = args[:i] + args[i + 2:]
    use_transformers = "--transformers" in args
    args = [a for a in args if a != "--transformers"]
    path, bos, eos = args
    if use_transformers:
        from transformers.utils.chat_template_utils import render_jinja_template
        src = open(path).read()
        out = {}
        for name, msgs in CONVERSATIONS.items():
            for agp in (True, False):
                rendered, _ = render_jinja_template([msgs], chat_template=src,
                                                    add_generation_prompt=agp, bos_token=bos,
                                                    eos_token=eos)
                out[f"{name}/{agp}"] = rendered[0]
        print(json.dumps(out, ensure_ascii=False, indent=1))
        return

    def raise_exception(msg):
        raise TemplateError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return (date or datetime.datetime.now()).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    t = env.from_string(open(path).read())
    out = {}
    for name, msgs in CONVERSATIONS.items():
        for agp in (True, False):
            out[f"{name}/{agp}"] = t.render(messages=msgs, add_generation_prompt=agp,
                                            bos_token=bos, eos_token=eos)
    print(json.dumps(out, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
