"""Model-independent pieces models share: text tokenization, chat templates, streaming detokenization, request
options, flow scheduling and guidance."""
