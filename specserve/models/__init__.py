"""Target models: our Llama-family implementation over the paged KV cache and tree attention."""
