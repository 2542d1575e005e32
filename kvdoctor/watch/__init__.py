"""``kvdoctor watch``: the live TUI an on-call engineer keeps open.

``command`` holds the click command (no Textual import, so ``kvdoctor --help`` stays fast);
``controller`` runs the one :class:`~kvdoctor.sampler.LiveLoop` on a worker thread and turns each
Cycle into a :class:`~kvdoctor.watch.controller.View` (no Textual either, tested on its own);
``app`` and ``panels`` draw the View with Textual, which only this command imports.
"""
