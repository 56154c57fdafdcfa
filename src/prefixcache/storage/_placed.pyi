def read_placed(
    path: str,
    buffer: bytearray,
    out: memoryview,
    offset: int,
    rows: int,
    src_row: int,
    copy_row: int,
    stride: int,
    /,
) -> tuple[int, bytes | None]: ...
