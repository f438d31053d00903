use super::*;
pub(crate) fn probe(_: &crate::transport::IoConfig) -> io::Result<()> {
    Err(io::Error::other("todo"))
}
pub(crate) fn run<H: Handler>(
    core: &mut Core<H>,
    listeners: &[Listener],
) -> Result<(), TransportError> {
    super::epoll::run(core, listeners)
}
