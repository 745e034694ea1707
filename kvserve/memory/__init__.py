"""Agent memory: stored responses (the Responses API's conversation state), facts, past turns as
vectors, relations between entities, and the assembler that builds a turn's context from them."""
