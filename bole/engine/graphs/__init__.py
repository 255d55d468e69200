"""CUDA graphs of the engine's forwards, one ``GraphFamily`` per forward kind (``base``): ar decode
(``decode``), short prefills (``prefill``), the MTP draft (``draft``) and the verify forward with its
acceptance / commit tails (``verify``, over ``tree``'s static forest context)."""
