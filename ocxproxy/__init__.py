"""ocxproxy: the stateful OpenAI Responses API in front of stateless inference servers."""

__version__ = "0.1.0"
