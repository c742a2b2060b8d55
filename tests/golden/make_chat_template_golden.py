#!/usr/bin/env python3
"""Record how llama.cpp's built-in chat renderer turns conversations into prompts.

Writes tests/golden/chat_templates.json: for each template text, how
llama.cpp (llama_chat_apply_template, the renderer llama-server uses when it
does not run Jinja) renders each conversation with the assistant's turn
opened, or that it knows no such template. Duet detects the same families
from the same markers (common/text/chat_template.cpp) and must render them
byte for byte alike; the templates it does not take (Llama 2's variants,
Phi-4, SmolVLM, anything unknown) it must refuse, and `duet` is the
expectation recorded beside llama.cpp's answer.

The template texts are short stand-ins that carry the markers llama.cpp's
detection reads (llm_chat_detect_template in src/llama-chat.cpp), as the real
templates of those families do; the conversations cover a lone user turn, a
system prompt, several turns with an assistant answer, and content with
leading and trailing spaces (which some families trim).

Run (paths default relative to the repository root):

    python3 tests/golden/make_chat_template_golden.py [--golden tests/golden/chat_templates.json]
"""
import argparse
import ctypes
import sys

from golden_util import FORMAT_VERSION, REFERENCE, repo_path, write_json

GENERATOR = "tests/golden/make_chat_template_golden.py"

# (name, template text, what Duet does: "render" or "refuse")
TEMPLATES = [
    ("chatml",
     "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
     "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
     "{% endif %}", "render"),
    ("qwen3",
     "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + content }}"
     "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
     "{%- endif %}{%- endfor %}", "render"),
    ("llama3",
     "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
     "'<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}{%- endfor %}", "render"),
    ("gemma",
     "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + role + '\\n' + "
     "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}", "render"),
    ("mistral-v1",
     "{{ bos_token }}{% for message in loop_messages %}{% if message['role'] == 'user' %}"
     "{{ ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}{% endif %}"
     "{% endfor %}", "render"),
    ("mistral-v3",
     "{{- bos_token }}{%- for message in loop_messages %}{%- if tools is not none %}"
     "{{- '[AVAILABLE_TOOLS] [' }}{%- endif %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
     "{%- endfor %}", "render"),
    ("mistral-v3-tekken",
     "{{- bos_token }}{%- for message in loop_messages %}{%- if tools is not none %}"
     "{{- \"[AVAILABLE_TOOLS]\" }}{%- endif %}{{- \"[INST]\" + message[\"content\"] + \"[/INST]\" }}"
     "{%- endfor %}", "render"),
    ("mistral-v7",
     "{{- bos_token }}{%- if system_message is defined %}{{- '[SYSTEM_PROMPT] ' + system_message + "
     "'[/SYSTEM_PROMPT]' }}{%- endif %}{%- for message in loop_messages %}{{- '[INST] ' + "
     "message['content'] + '[/INST]' }}{%- endfor %}", "render"),
    ("llama2",
     "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
     "message['content'] + ' [/INST]' }}{% elif message['role'] == 'system' %}"
     "{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}{% endif %}{% endfor %}", "refuse"),
    ("phi4",
     "{% for message in messages %}{{'<|im_start|>' + message['role'] + '<|im_sep|>' + "
     "message['content'] + '<|im_end|>'}}{% endfor %}", "refuse"),
    ("unknown",
     "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
     "{% endfor %}", "refuse"),
]

CONVERSATIONS = [
    ("user", [("user", "Hello there")]),
    ("system_user", [("system", "You are terse."), ("user", "Name a prime.")]),
    ("turns", [("system", "  Answer in one word.  "), ("user", " What is 2+2? "),
               ("assistant", " Four. "), ("user", "And 3+3?")]),
    ("markers", [("user", "Say <|im_start|> and [INST] and <start_of_turn> literally.")]),
]


def render(llama_cpp, template, messages):
    """llama.cpp's rendering with the assistant's turn opened, or None when it fails."""
    arr = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, (role, content) in enumerate(messages):
        keep += [role.encode(), content.encode()]
        arr[i].role = keep[-2]
        arr[i].content = keep[-1]
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template.encode(), arr, len(messages), True, buf, size)
    if n < 0:
        return None
    assert n < size, n
    return buf.raw[:n].decode("utf-8")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--golden", default="tests/golden/chat_templates.json")
    args = ap.parse_args()
    import llama_cpp

    cases = []
    for name, text, duet in TEMPLATES:
        rendered = {label: render(llama_cpp, text, messages) for label, messages in CONVERSATIONS}
        known = [r is not None for r in rendered.values()]
        assert all(known) or not any(known), name
        if duet == "render":
            assert all(known), f"llama.cpp does not know the {name} stand-in"
        cases.append({"name": name, "template": text, "duet": duet, "llama_cpp": rendered})
        print(f"{name}: llama.cpp {'renders it' if all(known) else 'knows no such template'}; "
              f"Duet must {duet} it", file=sys.stderr)
    doc = {
        "format_version": FORMAT_VERSION,
        "generator": GENERATOR,
        "reference": REFERENCE,
        "reference_version": llama_cpp.__version__,
        "about": ("llama_chat_apply_template(template, messages, add_ass = true): llama.cpp's "
                  "built-in renderer; null where it knows no such template. duet: 'render' "
                  "(byte for byte as llama.cpp) or 'refuse' (a template Duet does not take)."),
        "conversations": [{"name": label, "messages": [{"role": r, "content": c} for r, c in messages]}
                          for label, messages in CONVERSATIONS],
        "templates": cases,
    }
    write_json(repo_path(args.golden), doc)
    print(f"wrote {args.golden}", file=sys.stderr)


if __name__ == "__main__":
    main()
