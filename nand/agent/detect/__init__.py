"""Detection: what runs in the training step, on the device, never a sync.

Probes (``probes``) are launched by module and gradient hooks (``hooks``,
``grads``; which modules get which hook: ``modules``), by the optimizer hooks
(``optimizer``: gradient, parameter and state norms in one launch), under
``torch.compile`` into trace-time slots (``compiled``), for the loss scaler
(``amp``) and before DDP's all-reduce (``ddp``). ``names`` finds the real
model and optimizer inside framework wrappers.
"""
