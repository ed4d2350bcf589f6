"""Chat text in and out: messages and tools rendered through the checkpoint's chat template
(renderer), tool calls and reasoning parsed back from the model's answer. Pure text, no processes."""
