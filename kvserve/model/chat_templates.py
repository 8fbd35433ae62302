"""Chat templates for model families whose files may carry none.

A GGUF conversion can leave ``tokenizer.chat_template`` out (Gemma 3 270M's does); the
model-family registry asks ``builtin_chat_template`` for the family's and hands it to the
tokenizer. Each template here renders what the family's official template renders for the
conversations kvserve accepts (string contents; system, user, assistant and tool roles) and
refuses, through ``raise_exception``, what the family's format cannot hold.
"""

from __future__ import annotations

# Gemma 3: <bos>, then "<start_of_turn>{role}\n{content}<end_of_turn>\n" a turn, the assistant's
# role written "model", contents stripped of surrounding whitespace. A first system message is
# folded into the first user turn, followed by a blank line. Turns alternate user / model, the
# user's first. The official template raises for a conversation that does not alternate; it also
# renders a later system or a tool message under its own role name, which the model never saw in
# training, and drops a system message with no user turn after it: both are refused here.
_GEMMA3 = """\
{%- if messages[0]['role'] == 'system' -%}
    {%- set system_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system_prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if not turns -%}
    {{ raise_exception("Gemma's chat format folds a system message into the first user turn; "
                       "add a user message after it.") }}
{%- endif -%}
{{- bos_token -}}
{%- for message in turns -%}
    {%- set expected_role = 'user' if loop.index0 % 2 == 0 else 'assistant' -%}
    {%- if message['role'] != expected_role -%}
        {{ raise_exception("Gemma's chat format holds user and assistant turns, alternating from a user "
                           "turn, after at most one system message that comes first; message "
                           ~ (loop.index0 + messages|length - turns|length) ~ " is '" ~ message['role']
                           ~ "' where '" ~ expected_role ~ "' must be.") }}
    {%- endif -%}
    {{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\\n' -}}
    {{- system_prefix if loop.first else '' -}}
    {{- message['content'] | trim -}}
    {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

_BUILTIN = {"gemma3": _GEMMA3}


def builtin_chat_template(architecture: str) -> str | None:
    """The chat template kvserve writes for ``architecture`` (a GGUF ``general.architecture``),
    or None for families whose files carry their own."""
    return _BUILTIN.get(architecture)
