"""What only the book's chapters use, beside the library: finite differences (chapter 1), the
chapters' own versions of the op (the ``autograd.Function`` of chapter 4, the ``custom_op`` of
chapter 5, and chapter 8's minimal operator on public APIs, :mod:`tridiag_tutorial.book.minimal_op`,
written to be copied), and the parallel demos of chapter 17 with the runner that starts their
processes.

``import tridiag_tutorial`` does not import this package; it imports the library, never the other
way round."""
