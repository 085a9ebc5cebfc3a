"""Reference chat templates (jinja, Hugging Face conventions) for tokenizers built offline.

`CHATML_TEMPLATE` is the `<|im_start|>role ... <|im_end|>` layout of Qwen2/2.5 (tools in the system turn,
`<tool_call>` JSON for assistant calls, image/video/audio parts as Qwen-VL/Omni placeholders).
`LLAMA3_TEMPLATE` follows Llama 3.1 (header ids, dated system turn, `ipython` tool results).
`QWEN3_VL_CHAT_TEMPLATE` (Cosmos3) and `OMNI_CHAT_TEMPLATE` (Qwen3-Omni) are the same layout with no default
system turn, media parts as the checkpoints' placeholders; the Omni one also has audio and Qwen's tool turns.
Real checkpoints ship their own template; these exist for tests, tiny models and demos.
"""

CHATML_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- elif part.type in ['image', 'image_url'] -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type in ['video', 'video_url'] -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif part.type in ['audio', 'input_audio', 'audio_url'] -%}
                {{- '<|audio_bos|><|AUDIO|><|audio_eos|>' -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, ' }}
    {{- '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and (loop.first and tools) %}
    {%- elif message.role in ['system', 'user'] or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + render_content(message.content) }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- (call.arguments if call.arguments is string else call.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now('%d %b %Y') %}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}
    {{- 'Environment: ipython\\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- if tools is not none %}
    {{- 'You have access to the following functions. To call a function, respond with JSON of the form ' }}
    {{- '{"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role not in ['user', 'assistant', 'ipython', 'tool'] %}
        {{- raise_exception('Llama 3 roles are system, user, assistant and ipython; got ' ~ message.role) }}
    {%- endif %}
    {%- if message.tool_calls is defined and message.tool_calls %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {%- set role = 'ipython' if message.role == 'tool' else message.role %}
        {{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
        {%- if message.content is string %}
            {{- message.content | trim }}
        {%- else %}
            {%- for part in message.content %}
                {%- if part.type == 'text' %}{{ part.text | trim }}{% else %}{{ '<|image|>' }}{% endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


_QWEN_TOOLS = (  # Qwen's tools system turn (any system message first), as CHATML_TEMPLATE writes it
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}"
    "{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}"
    "{{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, ' }}"
    "{{- '\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
)
_QWEN_TOOL_TURNS = (  # an assistant turn's calls, and tool results as a user turn of <tool_response>s
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- (call['arguments'] if call['arguments'] is string else call['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)


def _qwen_media_template(audio: bool, tools: bool = False) -> str:
    """ChatML turns without a default system turn; each image, (audio,) and video part as its placeholder; with
    `tools`, Qwen's tool turns too (the tools system turn, assistant `<tool_call>`s, `<tool_response>`s)."""
    audio_part = ("{%- elif part['type'] in ('audio', 'input_audio', 'audio_url') %}"
                  "{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}") if audio else ""
    return (
        (_QWEN_TOOLS if tools else "") +
        "{%- for message in messages %}"
        + ("{%- if tools and loop.first and message['role'] == 'system' %}" + _QWEN_TOOL_TURNS + "{%- else %}"
           if tools else "") +
        "{{- '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'text' %}{{- part['text'] }}"
        "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
        + audio_part +
        "{%- elif part['type'] in ('video', 'video_url') %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
        "{%- endif %}{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        + ("{%- endif %}" if tools else "") +
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


QWEN3_VL_CHAT_TEMPLATE = _qwen_media_template(audio=False)
OMNI_CHAT_TEMPLATE = _qwen_media_template(audio=True, tools=True)
