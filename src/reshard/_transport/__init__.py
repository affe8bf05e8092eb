"""The executor's private machinery: the per-rank runner of a schedule, the views into
the caller's tensors, message checksums and the gather-and-broadcast baseline. Use
:class:`reshard.Executor`; nothing here is a public interface."""
