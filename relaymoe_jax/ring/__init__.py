"""The RelayMoE rings: the hop schedule (`schedule`), one hop's pairs in chunks (`hop`, `chunks`), the expert- and
token-routing rings (`expert`, `token`) with their shared custom VJP (`vjp`), and the choice between them from
the bytes each moves per hop (`volume`, `auto`)."""
