defmodule ElixirDemo.Subscriber do
  @moduledoc """
  A GenServer that joins a `:pg` group and forwards every message published to
  the group to a target with `:convoy.send/2`.

      {:ok, _} = ElixirDemo.Subscriber.start(group: :news, target: self())
      :ok = :convoy.publish(:news, {:headline, 1})
      # every member of :news, on every node, gets {:headline, 1}

  The group lives in OTP's default `:pg` scope (`:convoy.publish/2`), which
  must run on every node taking part (`:pg.start(:pg)`, or the kernel's
  `start_pg` setting).
  """
  use GenServer

  @doc """
  Starts a subscriber linked to the caller. Options: `:group` and `:target`
  (both required) and the usual GenServer options.
  """
  def start_link(opts) do
    {args, gen_opts} = Keyword.split(opts, [:group, :target])
    GenServer.start_link(__MODULE__, args, gen_opts)
  end

  @doc "Like `start_link/1` but unlinked, e.g. to start one on another node."
  def start(opts) do
    {args, gen_opts} = Keyword.split(opts, [:group, :target])
    GenServer.start(__MODULE__, args, gen_opts)
  end

  @impl true
  def init(args) do
    group = Keyword.fetch!(args, :group)
    :ok = :pg.join(group, self())
    {:ok, Keyword.fetch!(args, :target)}
  end

  @impl true
  def handle_info(msg, target) do
    :ok = :convoy.send(target, {self(), msg})
    {:noreply, target}
  end
end
