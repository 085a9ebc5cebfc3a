"""Pi0.5 (lerobot/pi05_base): a vision-language-action policy, SigLIP and a Gemma prefix read the cameras,
the task and the state; a Gemma action expert turns noise into an action chunk by flow matching."""
