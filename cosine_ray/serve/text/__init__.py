"""Text in and out: prompts through the chat template, tools, tool-call parsing, streamed detokenization."""
