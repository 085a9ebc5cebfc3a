"""Short chat prompts with checkable answers, shared by the SmolLM2 greedy-parity test and the FP8 accuracy
benchmark (the test reads the first twelve)."""

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying healthy.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Explain photosynthesis in one sentence.",
    "Name the planets of the solar system.",
    "Write a Python function that reverses a string.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Fahrenheit?",
    "Summarize the plot of Cinderella.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What are the primary colors?",
    "Give an example of a prime number larger than 100.",
)
