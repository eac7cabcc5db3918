%% @private
%% The sender's side of `convoy:publish/3': runs in the caller's process.
%%
%% The members of the group as this node's `pg' sees them now decide which nodes
%% get a copy: members on this node get `Msg' by a plain local send (as `!'), and
%% each other node with members gets one entry that travels like a multicast entry
%% (`convoy_route:multicast_entry/3'), so it keeps its place among the caller's
%% other convoy messages to that node. Which processes there get it is decided on
%% that node when its inbox delivers the entry: `pg:get_local_members/2' there.
%%
%% A node whose peer reads publish entries (protocol version 2) gets one
%% `{'$convoy_publish', Scope, Group, Msg}' entry. Any other node gets multicast
%% entries to its members as this node sees them, which the lane ships as such to a
%% version-1 peer and as plain sends to a node without convoy (if the peer's route
%% changes before the lane ships, the lane does the same conversion then). Without
%% convoy running here, every member gets a plain send.
-module(convoy_publish).

-export([publish/3]).

-include("convoy_runtime.hrl").
-include("convoy_tags.hrl").

%% @doc See `convoy:publish/3'.
-spec publish(atom(), term(), term()) -> ok.
publish(Scope, Group, Msg) when is_atom(Scope) ->
    %% pg answers [] for a scope that does not run: nothing would be delivered
    whereis(Scope) =:= undefined andalso
        erlang:error({badarg, {no_pg_scope, Scope}}, [Scope, Group, Msg]),
    case persistent_term:get(?RUNTIME_KEY, undefined) of
        undefined ->
            lists:foreach(fun(P) -> P ! Msg end, pg:get_members(Scope, Group));
        _ ->
            {Local, Nodes} = convoy_pg:split(pg:get_members(Scope, Group)),
            lists:foreach(fun(P) -> P ! Msg end, Local),
            lists:foreach(fun(Node) -> remote(Node, Scope, Group, Msg) end, Nodes)
    end;
publish(Scope, Group, Msg) ->
    erlang:error(badarg, [Scope, Group, Msg]).

%% A peer that does not read publish entries: multicast entries to the members
%% on Node (looked up again: rare, and the common case keeps no per-node lists).
remote(Node, Scope, Group, Msg) ->
    case reads_publish(convoy_peers:route(Node)) of
        true ->
            convoy_route:multicast_entry(Node, {?TAG_PUBLISH, Scope, Group}, Msg);
        false ->
            Pids = convoy_pg:members_on(Scope, Group, Node),
            lists:foreach(fun({Tos, _}) -> convoy_route:multicast_entry(Node, Tos, Msg) end,
                          convoy_wire:multicast_entries(Pids, Msg))
    end.

reads_publish({convoy, Vsn, _Inboxes}) -> convoy_wire:supports(Vsn, publish);
reads_publish(plain) -> false.
