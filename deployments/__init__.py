"""Ray Serve layer of Bole: OpenAI ingress, replica deployment, request router, app builders.

The ingress and the routing policy import without Ray (``ingress.openai_app`` over a local engine);
``app``, ``replica`` (Serve parts) and ``router`` need ``ray[serve]``.
"""
