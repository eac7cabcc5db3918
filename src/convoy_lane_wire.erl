%% @private
%% What a lane's entries become for the peer at hand. Pure, but for a publish
%% entry's members, read from `pg' as this node sees them now.
%%
%% A lane keeps one kind of entry in a form of its own: a large message
%% (`{'$convoy_large', To, Msg}', a publish's as `{'$convoy_large',
%% {'$convoy_publish', Scope, Group}, Msg}'); it queues a small publish as the
%% wire's publish entry (`convoy_wire:publish/3'). A peer at protocol version 2 or
%% later gets them as wire entries; a version-1 peer gets a publish as multicast
%% entries to its members; a peer without convoy gets plain sends
%% (`plain_entry/2').
-module(convoy_lane_wire).

-export([entries/3, plain_entry/2]).

-include("convoy_tags.hrl").

%% @doc A chunk's entries as the peer at version `Vsn' on `Node' reads them: a
%% chunk of small messages as it is, a run of large ones (a chunk is one or the
%% other, `convoy_batch', as the lane's `ship/4' reads it) as wire entries; a
%% peer at a version without publish entries gets each as multicast entries to
%% its members as this node sees them now (what a loop of sends would reach).
-spec entries([term()], pos_integer(), node()) -> [term()].
entries(Wire, Vsn, Node) ->
    case convoy_wire:supports(Vsn, publish) of
        true ->
            case Wire of
                [{?TAG_LARGE, _, _} | _] -> [wire_entry(E) || E <- Wire];
                _ -> Wire
            end;
        false ->
            lists:flatmap(fun(E) -> v1_entries(plain_entry(E, Node)) end, Wire)
    end.

v1_entries({Tos, Msg}) when is_list(Tos) -> convoy_wire:multicast_entries(Tos, Msg);
v1_entries(E) -> [E].

%% @doc An entry as sends to destinations: a publish becomes a multicast to the
%% group's members on `Node' as this node sees them now.
-spec plain_entry(term(), node()) -> {term(), term()}.
plain_entry(E, Node) ->
    case wire_entry(E) of
        {?TAG_PUBLISH, Scope, Group, Msg} -> {convoy_pg:members_on(Scope, Group, Node), Msg};
        Plain -> Plain
    end.

%% A large message (a publish's too) as its wire entry; any other entry is one.
wire_entry({?TAG_LARGE, To, Msg}) -> wire_entry({To, Msg});
wire_entry({{?TAG_PUBLISH, Scope, Group}, Msg}) -> convoy_wire:publish(Scope, Group, Msg);
wire_entry(E) -> E.
