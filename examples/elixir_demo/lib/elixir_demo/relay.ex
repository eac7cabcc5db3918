defmodule ElixirDemo.Relay do
  @moduledoc """
  A GenServer that forwards every message it receives to a target with
  `:convoy.send/2`: messages relayed to another node arrive in the order the
  relay received them, and convoy batches them whenever they queue up.

      {:ok, relay} = ElixirDemo.Relay.start_link(target: {:inbox, :"b@host"})
      send(relay, :hello)
      # :inbox on b@host receives :hello, sent with :convoy.send/2
  """
  use GenServer

  @doc """
  Starts a relay linked to the caller. Options: `:target` (required; a pid,
  a registered name, `{name, node}` or an alias) and the usual GenServer
  options (`:name`, ...).
  """
  def start_link(opts) do
    {target, gen_opts} = Keyword.pop!(opts, :target)
    GenServer.start_link(__MODULE__, target, gen_opts)
  end

  @doc "Like `start_link/1` but unlinked, e.g. to start a relay on another node."
  def start(opts) do
    {target, gen_opts} = Keyword.pop!(opts, :target)
    GenServer.start(__MODULE__, target, gen_opts)
  end

  @impl true
  def init(target), do: {:ok, target}

  @impl true
  def handle_info(msg, target) do
    :ok = :convoy.send(target, msg)
    {:noreply, target}
  end
end
